"""Tests for disttrain_tools.synth: layout, metadata consistency, determinism, skew, corrupt shard,
audio / interleaved / generation / conversation / video samples, images stored as the web stores them
(every class read back from the written bytes), camera shards in img2dataset's keep-original-bytes
layout."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import json
import re
import statistics
import tarfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import soundfile
from PIL import Image

from disttrain_api.config import ImageConfig
from disttrain_tools import synth
from preprocess_service.adapters.io.img2dataset import read_manifest
from preprocess_service.adapters.media.parse import parse_document
from preprocess_service.core.sample import TextSegment
from preprocess_service.core.tokenizer import ByteTokenizer

MEMBER = re.compile(r"^(\d{5})(\d{4})\.(?:(\d+)\.)?(jpg|png|webp|flac|wav|mp3|ogg|mp4|txt|json)$")
IMAGE_EXTS = ("jpg", "png", "webp")
AUDIO_EXTS = ("flac", "wav", "mp3", "ogg")
SKEW_CONFIG = synth.SynthConfig(num_shards=2, samples_per_shard=200, seed=0)


def read_samples(tar_path: Path) -> dict[str, dict[str, bytes]]:
    """{key: {extension: bytes}}, splitting member names at the first dot as webdataset does."""
    samples: dict[str, dict[str, bytes]] = {}
    with tarfile.open(tar_path) as tar:
        for member in tar.getmembers():
            key, ext = member.name.split(".", 1)
            samples.setdefault(key, {})[ext] = tar.extractfile(member).read()
    return samples


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[Path, list[Path]]:
    """One ~400-sample dataset shared by the layout, consistency and skew tests (generation dominates runtime)."""
    out = tmp_path_factory.mktemp("synth")
    return out, synth.write_dataset(out, SKEW_CONFIG)


@pytest.fixture(scope="module")
def all_metas(dataset) -> list[dict]:
    _, tars = dataset
    return [json.loads(s["json"]) for tar in tars for s in read_samples(tar).values()]


def test_layout(dataset):
    out, tars = dataset
    assert tars == [out / "00000.tar", out / "00001.tar"]
    for shard in range(SKEW_CONFIG.num_shards):
        stats = json.loads((out / f"{shard:05d}_stats.json").read_text())
        n = SKEW_CONFIG.samples_per_shard
        assert stats["count"] == stats["successes"] == n
        assert stats["status_dict"] == {"success": n}
        assert stats["failed_to_download"] == stats["failed_to_resize"] == 0
        assert stats["end_time"] >= stats["start_time"]
    assert (out / synth.MARKER_NAME).is_file()


def test_member_names_encode_shard_and_index(dataset):
    _, tars = dataset
    for shard, tar_path in enumerate(tars):
        with tarfile.open(tar_path) as tar:
            names = tar.getnames()
        indexes = set()
        for name in names:
            match = MEMBER.match(name)
            assert match, name
            assert int(match.group(1)) == shard
            indexes.add(int(match.group(2)))
        assert indexes == set(range(SKEW_CONFIG.samples_per_shard))


def sample_kind(meta: dict) -> str:
    if meta.get("kind") == "text":
        return "text"
    if "num_video" in meta:
        return "video"
    if "conversations" in meta:
        return "conversation"
    if "generate" in meta:
        return "generate"
    if "order" in meta:
        return "interleaved"
    return "audio" if "num_audio" in meta else "plain"


def check_sample(key: str, members: dict[str, bytes], meta: dict) -> None:
    if sample_kind(meta) == "plain":
        check_plain_sample(key, members, meta)
    elif sample_kind(meta) == "conversation":
        check_conversation_sample(key, members, meta)
    elif sample_kind(meta) == "video":
        check_video_sample(key, members, meta)
    else:
        check_mixed_sample(key, members, meta)
    first_image = next((members[name] for name in members if name in IMAGE_EXTS), None)
    if first_image is not None:  # img2dataset's exif column: exifread's name of the first image's orientation
        orientation = Image.open(io.BytesIO(first_image)).getexif().get(0x0112)
        assert json.loads(meta["exif"]).get("Image Orientation") == synth.ORIENTATION_NAMES.get(orientation)


def check_video_sample(key: str, members: dict[str, bytes], meta: dict) -> None:
    """An mp4 and a caption; json: the stored frame size, the frames' duration, the rotation the
    display matrix (read back with PyAV) applies."""
    import av

    assert sorted(members) == ["json", "mp4", "txt"] and members["txt"].decode("utf-8") == meta["caption"]
    assert meta["key"] == key and meta["num_images"] == 0 and meta["num_video"] == 1
    assert meta["sha256"] == hashlib.sha256(members["mp4"]).hexdigest() and meta["url"].endswith(f"{key}.mp4")
    with av.open(io.BytesIO(members["mp4"])) as container:
        stream = container.streams.video[0]
        frames = list(container.decode(stream))
        assert stream.codec_context.name == "h264" and (stream.width, stream.height) == (meta["width"], meta["height"])
    assert meta["width"] > meta["height"]  # stored landscape, as a phone's sensor records it
    assert abs(len(frames) / float(stream.average_rate) - meta["video_seconds"]) < 1e-6
    side = frames[0].side_data.get("DISPLAYMATRIX")
    matrix = np.frombuffer(bytes(side), dtype=np.int32).tolist() if side is not None else None
    assert matrix == (synth.display_matrix(meta["rotation"]) if meta["rotation"] else None)


def check_plain_sample(key: str, members: dict[str, bytes], meta: dict) -> None:
    first_ext = next(ext for ext in IMAGE_EXTS if ext in members)
    assert meta["key"] == key and meta["status"] == "success" and meta["error_message"] is None
    assert members["txt"].decode("utf-8") == meta["caption"]
    assert meta["sha256"] == hashlib.sha256(members[first_ext]).hexdigest()
    assert meta["url"].endswith(f"{key}.{first_ext}")
    assert 0.25 <= meta["similarity"] <= 0.4
    assert meta["original_width"] >= meta["width"] and meta["original_height"] >= meta["height"]
    extra = sorted(int(ext.split(".")[0]) for ext in members if ext.count(".") == 1)
    assert extra == list(range(1, meta["num_images"]))
    # The json describes the stored pixel array (EXIF orientation is not applied), as img2dataset does.
    sizes = [Image.open(io.BytesIO(members[first_ext])).size]
    sizes += [Image.open(io.BytesIO(members[f"{i}.jpg"])).size for i in extra]
    assert sizes[0] == (meta["width"], meta["height"])
    if meta["num_images"] > 1:
        assert [(d["width"], d["height"]) for d in meta["images"]] == sizes
    else:
        assert "images" not in meta
    assert not {"num_audio", "duration", "durations", "sample_rate", "order", "generate"} & set(meta)


def check_conversation_sample(key: str, members: dict[str, bytes], meta: dict) -> None:
    """One image, no text member; 2-4 turns alternating human and gpt (after an optional system
    turn), the first question placing the image; parsed, only the answers are trained."""
    assert sorted(members) == sorted([next(ext for ext in IMAGE_EXTS if ext in members), "json"])
    turns = meta["conversations"]
    roles = [t["from"] for t in turns]
    assert 2 <= len(turns) <= 4 and roles in (["human", "gpt"], ["system", "human", "gpt"], ["human", "gpt"] * 2)
    questions = [t["value"] for t in turns if t["from"] == "human"]
    assert questions[0].startswith("<image>\n") and all("<image>" not in q for q in questions[1:])
    answers = [t["value"] for t in turns if t["from"] == "gpt"]
    assert meta["caption"] == answers[0] and meta["num_images"] == 1 and meta["key"] == key
    doc = parse_document({"__key__": key, **members}, image_config=ImageConfig(), tokenizer=ByteTokenizer(),
                         seq_len=4096)
    trained = [ByteTokenizer().decode(s.ids) for s in doc.segments if isinstance(s, TextSegment) and s.trainable]
    assert trained == answers and doc.trains_eos


def by_modality(members: dict[str, bytes]) -> dict[str, list[str]]:
    """{"image"|"audio"|"text": member names by index}; every member but json must have a modality."""
    found: dict[str, list[tuple[int, str]]] = {"image": [], "audio": [], "text": []}
    for name in members:
        if name == "json":
            continue
        ext = name.rsplit(".", 1)[-1]
        modality = "image" if ext in IMAGE_EXTS else "audio" if ext in AUDIO_EXTS else "text" if ext == "txt" else None
        assert modality, name
        found[modality].append((int(name.split(".")[0]) if "." in name else 0, name))
    out = {}
    for modality, pairs in found.items():
        pairs.sort()
        assert [idx for idx, _ in pairs] == list(range(len(pairs))), pairs  # "ext", "1.ext", "2.ext", ...
        out[modality] = [name for _, name in pairs]
    return out


def check_clip(data: bytes, duration: float) -> int:
    """Decodes a clip; checks its length against the declared duration; returns its sample rate."""
    wave, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    assert rate in synth.SAMPLE_RATES and wave.shape[1] in (1, 2)
    assert abs(len(wave) / rate - duration) <= 1 / rate  # within one frame
    assert 0.5 - 1 / rate <= duration <= 20.0
    assert 0.05 < float(abs(wave).max()) <= 0.51  # not silent, within [-0.5, 0.5] (plus codec ripple)
    return rate


def check_mixed_sample(key: str, members: dict[str, bytes], meta: dict) -> None:
    """An audio, interleaved or generation sample: members, json fields, decodable clips, order."""
    kind = sample_kind(meta)
    parts = by_modality(members)
    images, clips, texts = parts["image"], parts["audio"], parts["text"]
    assert meta["key"] == key and meta["status"] == "success" and meta["error_message"] is None
    assert members["txt"].decode("utf-8") == meta["caption"]
    for name in texts:
        assert members[name].decode("utf-8").strip()
    assert 0.25 <= meta["similarity"] <= 0.4
    assert meta["num_images"] == len(images) and meta["num_audio"] == len(clips)
    assert all(name.endswith("jpg") for name in images[1:])  # like plain samples: only the first varies
    named = meta["url"].rsplit("/", 1)[1].split(".", 1)[1]  # the member the url (and sha256) describe
    if kind == "interleaved":
        assert named == "html" and meta["sha256"] == hashlib.sha256(members[images[0]]).hexdigest()
    else:
        assert named == (clips or images)[0] and meta["sha256"] == hashlib.sha256(members[named]).hexdigest()
    sizes = [Image.open(io.BytesIO(members[name])).size for name in images]  # stored, as img2dataset's
    if sizes:
        assert sizes[0] == (meta["width"], meta["height"])
        assert meta["original_width"] >= meta["width"] and meta["original_height"] >= meta["height"]
        if len(sizes) > 1:
            assert [(d["width"], d["height"]) for d in meta["images"]] == sizes
        else:
            assert "images" not in meta
    else:
        assert meta["width"] is meta["height"] is meta["original_width"] is meta["original_height"] is None
    if clips:
        assert meta["duration"] == meta["durations"][0] and len(meta["durations"]) == len(clips)
        rates = [check_clip(members[name], duration) for name, duration in zip(clips, meta["durations"])]
        assert meta["sample_rate"] == rates[0]
    else:
        assert not {"duration", "durations", "sample_rate"} & set(meta)
    if "order" in meta:  # exactly the sample's text and media members, each once
        assert sorted(meta["order"]) == sorted(images + clips + texts)
    if kind == "audio":
        assert 1 <= len(clips) <= 2 and len(images) <= 1 and texts == ["txt"]
    elif kind == "interleaved":
        assert len(texts) >= 2 and images
    else:
        assert not clips and texts == ["txt"] and 1 <= len(images) <= 2
        assert meta["order"] == ["txt", *images] and meta["generate"] == images[-1:]


def test_json_matches_images_and_parquet(dataset):
    out, tars = dataset
    for shard, tar_path in enumerate(tars):
        samples = read_samples(tar_path)
        metas = {key: json.loads(members["json"]) for key, members in samples.items()}
        for key, members in samples.items():
            check_sample(key, members, metas[key])
        table = pq.read_table(out / f"{shard:05d}.parquet")
        assert table.num_rows == len(samples)
        assert set(table.column_names) >= {"duration", "durations", "sample_rate", "order", "generate"}
        for row in table.to_pylist():
            meta = metas[row["key"]]
            assert set(meta) - {"images"} <= set(row)
            assert row == {column: meta.get(column) for column in table.column_names}
        assert not read_manifest(tar_path).plannable  # rows of several images, audio, video: read as tars


def test_formats_and_utf8(all_metas, dataset):
    _, tars = dataset
    exts = {ext for tar in tars for members in read_samples(tar).values() for ext in members}
    assert {"jpg", "png", "webp", "1.jpg", "txt", "json", "1.txt", *AUDIO_EXTS} <= exts
    assert any(not meta["caption"].isascii() for meta in all_metas)


def test_skew(all_metas):
    assert len(all_metas) == 400
    short_sides = [min(d["width"], d["height"]) for m in all_metas if "num_video" not in m
                   for d in m.get("images", [m]) if d["width"]]
    assert 300 <= statistics.median(short_sides) <= 650
    assert max(short_sides) > 1500
    odd = [side for side in short_sides if side < 150]  # 1x1, 3x2, one pixel wide, strips: ODD_SIZE_SHARE
    assert 0 < len(odd) <= 0.03 * len(short_sides) and max(odd) <= 80
    assert max(short_sides) <= 3000
    words = [len(m["caption"].split()) for m in all_metas]
    assert 8 <= statistics.median(words) <= 18
    assert max(words) > 60
    multi_share = sum(m["num_images"] > 1 for m in all_metas) / len(all_metas)
    assert 0.04 <= multi_share <= 0.20
    assert max(m["num_images"] for m in all_metas) <= 8
    durations = [d for m in all_metas for d in m.get("durations", [])]
    assert 2.5 <= statistics.median(durations) <= 6.5


def test_sample_kinds(dataset, all_metas):
    """Every kind turns up in roughly its share; audio-only and audio-with-image, 1 and 2 clips; WAV
    16- and 24-bit, mono and stereo, several sample rates; generation with and without an input image."""
    kinds = [sample_kind(m) for m in all_metas]
    shares = {kind: kinds.count(kind) / len(kinds) for kind in synth.SAMPLE_KINDS}
    assert 0.05 <= shares["audio"] <= 0.16
    assert 0.02 <= shares["interleaved"] <= 0.10 and 0.02 <= shares["generate"] <= 0.10
    assert 0.005 <= shares["conversation"] <= 0.07 and shares["video"] == 0.0  # videos: off by default
    audio = [m for m in all_metas if sample_kind(m) == "audio"]
    assert {m["num_images"] for m in audio} == {0, 1} and {m["num_audio"] for m in audio} == {1, 2}
    assert {len(m["generate"]) == m["num_images"] for m in all_metas if "generate" in m} == {True, False}
    assert any(m["num_audio"] for m in all_metas if sample_kind(m) == "interleaved")
    infos = [soundfile.info(io.BytesIO(data)) for tar in dataset[1] for members in read_samples(tar).values()
             for name, data in members.items() if name.rsplit(".", 1)[-1] in AUDIO_EXTS]
    assert {"PCM_16", "PCM_24"} <= {i.subtype for i in infos if i.format == "WAV"}
    assert {i.channels for i in infos} == {1, 2} and len({i.samplerate for i in infos}) >= 4


def image_class(ext: str, data: bytes) -> str:
    """The class of synth.ENCODINGS[ext] an image is stored in, told from its bytes alone."""
    image = Image.open(io.BytesIO(data))
    if ext == "jpg":
        if image.mode == "CMYK":
            return "ycck" if image.info.get("adobe_transform") == 2 else "cmyk"
        return "grey" if image.mode == "L" else "progressive" if image.info.get("progressive") else "baseline"
    if ext == "webp":  # the first chunk: VP8L is lossless, VP8X lossy with an alpha chunk, "VP8 " plain lossy
        return "lossless_alpha" if data[12:16] == b"VP8L" else "lossy_alpha" if image.mode == "RGBA" else "lossy"
    if data[24] == 16:  # the IHDR's bit depth
        return "rgb16" if image.mode == "RGB" else "grey16"
    if image.mode == "P":
        transparency = image.info.get("transparency")
        return ("palette" if transparency is None else "palette_key" if isinstance(transparency, int)
                else "palette_alpha")
    return {"RGB": "rgb", "RGBA": "rgba", "L": "grey"}[image.mode]


def image_members(members: dict[str, bytes]):
    """(format, bytes) of every image member of a sample."""
    return [(name.rsplit(".", 1)[-1], data) for name, data in members.items() if name.rsplit(".", 1)[-1] in IMAGE_EXTS]


def decode_through_the_service(key: str, members: dict[str, bytes]) -> int:
    """Parses the sample as the service does and decodes each of its images, images to generate and
    videos (to the planned shape); returns how many."""
    from preprocess_service.adapters.decode.items import decode_item
    from preprocess_service.core.modalities import MODALITIES
    from preprocess_service.core.sample import GenImageRef, ImageRef, VideoRef

    doc = parse_document({"__key__": key, **members}, image_config=ImageConfig(), tokenizer=ByteTokenizer(),
                         seq_len=8192)
    kinds = {ImageRef: "image", GenImageRef: "gen", VideoRef: "video"}
    media = [s for s in doc.segments if type(s) in kinds]
    for ref in media:
        kind = kinds[type(ref)]
        shape, params = MODALITIES[kind].slot(ref, None)
        assert decode_item(kind, members[ref.member], params, np.empty(shape, dtype=np.uint8)).shape == shape
    return len(media)


def test_default_shares_store_images_as_the_web_does(dataset):
    """At the default shares: EXIF orientations (2-8 on about exif_rotated_share of the JPEGs, 1 on
    others), progressive, grey and CMYK JPEGs; PNGs with alpha, palettes and 16 bits; WebP with
    alpha; a few odd sizes (test_skew)."""
    classes: collections.Counter = collections.Counter()
    orientations: collections.Counter = collections.Counter()
    for tar in dataset[1]:
        for members in read_samples(tar).values():
            for ext, data in image_members(members):
                classes[ext, image_class(ext, data)] += 1
                if ext == "jpg":
                    orientations[Image.open(io.BytesIO(data)).getexif().get(0x0112)] += 1
    jpegs = sum(n for (ext, _), n in classes.items() if ext == "jpg")
    assert 0.08 <= classes["jpg", "progressive"] / jpegs <= 0.25
    assert {("jpg", "grey"), ("jpg", "cmyk"), ("png", "rgba"), ("png", "rgb16"), ("webp", "lossy_alpha"),
            ("webp", "lossless_alpha")} <= set(classes)
    assert len({(ext, c) for ext, c in classes if ext == "png"}) >= 5
    rotated = {o: n for o, n in orientations.items() if o and o > 1}
    assert 0.02 <= sum(rotated.values()) / jpegs <= 0.10 and len(rotated) >= 3 and max(rotated, key=rotated.get) == 6
    assert 0.03 <= orientations[1] / jpegs <= 0.20


def test_every_image_class_is_written_as_that_class_and_the_service_decodes_it(tmp_path, monkeypatch):
    """Every class of synth.ENCODINGS, every EXIF orientation and the odd sizes turn up when drawn
    evenly, read back from the bytes as what they claim to be, and the service parses and decodes
    every image (and video) of the corpus."""
    monkeypatch.setattr(synth, "ENCODINGS", {ext: dict.fromkeys(c, 1.0) for ext, c in synth.ENCODINGS.items()})
    monkeypatch.setattr(synth, "WEB_ROTATIONS", dict.fromkeys(synth.WEB_ROTATIONS, 1.0))
    monkeypatch.setattr(synth, "ODD_SIZE_SHARE", 0.25)
    monkeypatch.setattr(synth, "UPRIGHT_TAG_SHARE", 0.3)
    config = synth.SynthConfig(num_shards=1, samples_per_shard=100, seed=2, png_share=0.45, webp_share=0.3,
                               exif_rotated_share=0.5, multi_image_share=0.3, max_images=4, video_share=0.03)
    classes, orientations, small = set(), set(), set()
    decoded = media = 0
    for key, members in read_samples(synth.write_dataset(tmp_path, config)[0]).items():
        check_sample(key, members, json.loads(members["json"]))
        media += len(image_members(members)) + ("mp4" in members)
        for ext, data in image_members(members):
            classes.add((ext, image_class(ext, data)))
            with Image.open(io.BytesIO(data)) as image:
                orientations.add(image.getexif().get(0x0112))
                small.add(image.size if max(image.size) <= 3 else (min(image.size), "strip") if min(image.size) < 100
                          else None)
        decoded += decode_through_the_service(key, members)
    assert classes == {(ext, c) for ext, weights in synth.ENCODINGS.items() for c in weights}
    assert orientations == {None, *range(1, 9)}
    assert {(1, 1), (3, 2), (1, "strip"), (20, "strip")} <= small
    assert decoded == media > 100


def test_camera_shards_are_img2dataset_keeping_the_original_bytes(tmp_path):
    """A camera shard: phone JPEGs with their EXIF (orientation 1-8, make, model, maker note), stored
    landscape; the json and parquet hold img2dataset's own columns with the stored size, so the
    service plans the shard from the parquet (Manifest.plannable)."""
    config = synth.SynthConfig(num_shards=1, samples_per_shard=160, seed=4, camera_every=1)
    tar = synth.write_dataset(tmp_path, config)[0]
    table = pq.read_table(tmp_path / "00000.parquet")
    assert table.schema.equals(synth.IMG2DATASET_SCHEMA)
    rows = {row["key"]: row for row in table.to_pylist()}
    samples = read_samples(tar)
    orientations: collections.Counter = collections.Counter()
    for key, members in samples.items():
        meta = json.loads(members["json"])
        assert sorted(members) == ["jpg", "json", "txt"] and meta == rows[key] and meta["status"] == "success"
        assert members["txt"].decode("utf-8") == meta["caption"]
        assert meta["sha256"] == hashlib.sha256(members["jpg"]).hexdigest()
        image = Image.open(io.BytesIO(members["jpg"]))
        assert image.format == "JPEG" and image.mode == "RGB" and image.width > image.height
        assert (meta["width"], meta["height"]) == image.size == (meta["original_width"], meta["original_height"])
        exif = image.getexif()
        orientations[exif[0x0112]] += 1
        assert json.loads(meta["exif"]) == {"Image Make": exif[0x010F], "Image Model": exif[0x0110],
                                            "Image Orientation": synth.ORIENTATION_NAMES[exif[0x0112]]}
        assert len(exif.get_ifd(0x8769)[0x927C]) >= 2048  # the maker note
    assert set(orientations) == set(range(1, 9)) and [o for o, _ in orientations.most_common(2)] == [1, 6]
    manifest = read_manifest(tar)
    assert manifest.plannable and manifest.keys == tuple(samples)
    assert manifest.width.tolist() == [rows[key]["width"] for key in samples]


def test_the_default_demo_has_a_camera_shard(tmp_path):
    """What ``./dev.sh run`` writes (SynthConfig()): its last shard of four holds camera originals
    with a plannable parquet, the others mixed samples (not plannable)."""
    default = synth.SynthConfig()
    assert [default.is_camera_shard(s) for s in range(default.num_shards)] == [False, False, False, True]
    assert default.image_variety and default.exif_rotated_share > 0
    tars = synth.write_dataset(tmp_path, dataclasses.replace(default, samples_per_shard=24))
    assert [read_manifest(tar).plannable for tar in tars] == [False, False, False, True]
    assert [s for s in range(8) if default.is_camera_shard(s)] == [3, 7]  # one shard in four
    assert not any(synth.SynthConfig(camera_every=0).is_camera_shard(s) for s in range(8))


def test_the_demo_carries_phone_videos_turned_by_their_display_matrix(tmp_path):
    """``./dev.sh run``'s corpus (jobs.demo_config): synth's defaults plus phone videos, most turned."""
    from disttrain_tools.jobs import demo_config

    demo = demo_config()
    assert dataclasses.replace(demo, video_share=0.0) == synth.SynthConfig() and demo.video_share > 0
    tars = synth.write_dataset(tmp_path, dataclasses.replace(demo, num_shards=1, samples_per_shard=200))
    metas = [json.loads(s["json"]) for s in read_samples(tars[0]).values() if "mp4" in s]
    assert metas and any(m["rotation"] for m in metas), metas


def test_videos_are_phone_videos_with_a_display_rotation(tmp_path):
    """Videos: H.264 mp4s stored landscape, most turned by a display matrix; the service shows them
    turned (a quarter turn swaps the planned frame's sides)."""
    from preprocess_service.core.sample import VideoRef

    config = synth.SynthConfig(num_shards=1, samples_per_shard=24, seed=6, video_share=0.6)
    samples = read_samples(synth.write_dataset(tmp_path, config)[0])
    rows = {row["key"]: row for row in pq.read_table(tmp_path / "00000.parquet").to_pylist()}
    rotations: collections.Counter = collections.Counter()
    for key, members in samples.items():
        meta = json.loads(members["json"])
        assert rows[key] == {column: meta.get(column) for column in rows[key]}
        if sample_kind(meta) != "video":
            continue
        check_sample(key, members, meta)
        rotations[meta["rotation"]] += 1
        doc = parse_document({"__key__": key, **members}, image_config=ImageConfig(), tokenizer=ByteTokenizer(),
                             seq_len=8192)
        (ref,) = [s for s in doc.segments if isinstance(s, VideoRef)]
        assert ref.orientation == {0: 1, 90: 6, 180: 3, 270: 8}[meta["rotation"]]
        assert (ref.width > ref.height) == (meta["rotation"] in (0, 180))
    assert sum(rotations.values()) >= 8 and len(rotations) >= 3 and rotations.most_common(1)[0][0] == 90


def test_plain_samples_do_not_depend_on_the_new_shares(tmp_path):
    """The sample kind has its own random stream: a plain sample is the same with any new shares."""
    config = synth.SynthConfig(num_shards=1, samples_per_shard=20, seed=3, audio_share=0.3, generate_share=0.2)
    only_plain = synth.SynthConfig(num_shards=1, samples_per_shard=20, seed=3, audio_share=0.0,
                                   interleaved_share=0.0, generate_share=0.0)
    mixed = read_samples(synth.write_dataset(tmp_path / "mixed", config)[0])
    plain = read_samples(synth.write_dataset(tmp_path / "plain", only_plain)[0])
    kept = [key for key, members in mixed.items() if sample_kind(json.loads(members["json"])) == "plain"]
    assert 5 <= len(kept) < 20
    assert all(mixed[key] == plain[key] for key in kept)


def test_text_only_documents(tmp_path):
    """text_share adds text-only documents of lognormal length; the other samples stay as they were."""
    config = synth.SynthConfig(num_shards=1, samples_per_shard=60, seed=5, text_share=0.4, text_words=100)
    base = dataclasses.replace(config, text_share=0.0)
    with_text = read_samples(synth.write_dataset(tmp_path / "t", config)[0])
    without = read_samples(synth.write_dataset(tmp_path / "b", base)[0])
    texts = {key: m for key, m in with_text.items() if sample_kind(json.loads(m["json"])) == "text"}
    assert 0.2 <= len(texts) / len(with_text) <= 0.6
    for key, members in texts.items():
        assert set(members) == {"txt", "json"}, key
        meta = json.loads(members["json"])
        assert meta["num_images"] == 0 and 20 <= meta["words"] <= 2000
        assert len(members["txt"].decode("utf-8").split()) == meta["words"]
    lengths = sorted(json.loads(m["json"])["words"] for m in texts.values())
    assert 50 <= lengths[len(lengths) // 2] <= 200 and lengths[-1] > 2 * lengths[0]
    assert all(with_text[key] == without[key] for key in with_text if key not in texts)
    with pytest.raises(ValueError, match="text_words"):
        synth.SynthConfig(text_words=0)
    with pytest.raises(ValueError, match="add up"):
        synth.SynthConfig(audio_share=0.5, text_share=0.6)


def test_same_seed_gives_identical_tars(tmp_path):
    # Many audio samples, so that MP3 and OGG (whose stream serial libsndfile seeds from the clock) occur.
    # Videos too: x264's output must not depend on the machine (one encoder thread).
    config = synth.SynthConfig(num_shards=1, samples_per_shard=16, seed=7, audio_share=0.55,
                               interleaved_share=0.1, generate_share=0.1, video_share=0.22)
    first_path = synth.write_dataset(tmp_path / "a", config)[0]
    first = first_path.read_bytes()
    exts = {name.rsplit(".", 1)[-1] for members in read_samples(first_path).values() for name in members}
    assert {"mp3", "ogg", "flac", "wav", "mp4"} <= exts
    second = synth.write_dataset(tmp_path / "b", config)[0].read_bytes()
    assert first == second
    other = synth.write_dataset(tmp_path / "c", dataclasses.replace(config, seed=8))
    assert other[0].read_bytes() != first


def test_ensure_dataset_reuses_only_a_matching_dataset(tmp_path):
    config = synth.SynthConfig(num_shards=2, samples_per_shard=3)
    paths = synth.ensure_dataset(tmp_path, config)
    stamps = [p.stat().st_mtime_ns for p in paths]
    assert synth.ensure_dataset(tmp_path, config) == paths
    assert [p.stat().st_mtime_ns for p in paths] == stamps
    smaller = synth.SynthConfig(num_shards=1, samples_per_shard=3, seed=1)
    assert synth.ensure_dataset(tmp_path, smaller) == [tmp_path / "00000.tar"]
    assert not (tmp_path / "00001.tar").exists()  # stale shard of the earlier, bigger run removed
    assert json.loads((tmp_path / synth.MARKER_NAME).read_text())["config"]["seed"] == 1


@pytest.mark.parametrize(
    "kwargs",
    [{"num_shards": 0}, {"samples_per_shard": 10001}, {"seed": -1}, {"max_images": 1},
     {"multi_image_share": 1.5}, {"png_share": 0.6, "webp_share": 0.6}, {"num_shards": 2.0},
     {"webp_share": "0.1"}, {"audio_share": -0.1}, {"generate_share": True},
     {"audio_share": 0.5, "interleaved_share": 0.3, "generate_share": 0.3}, {"video_share": 1.1},
     {"audio_share": 0.6, "video_share": 0.5}, {"camera_every": -1}, {"camera_every": 1.0},
     {"image_variety": 1}],
)
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        synth.SynthConfig(**kwargs)


def check_bad_sample(kind: str, members: dict[str, bytes]) -> None:
    if kind == "truncated_image":
        with pytest.raises(OSError):
            Image.open(io.BytesIO(members["jpg"])).load()
    elif kind == "random_bytes_image":
        with pytest.raises(Image.UnidentifiedImageError):
            Image.open(io.BytesIO(members["jpg"]))
    elif kind == "bad_utf8":
        with pytest.raises(UnicodeDecodeError):
            members["txt"].decode("utf-8")
    elif kind == "invalid_json":
        with pytest.raises(json.JSONDecodeError):
            json.loads(members["json"])
    elif kind == "corrupt_audio":
        meta = json.loads(members["json"])
        (clip,) = by_modality(members)["audio"]
        assert clip in AUDIO_EXTS and meta["duration"] > 0 and meta["num_audio"] == 1
        assert members["txt"].decode("utf-8") == meta["caption"]
        with pytest.raises(soundfile.LibsndfileError):
            soundfile.info(io.BytesIO(members[clip]))
    else:
        assert kind == "decompression_bomb"
        assert json.loads(members["json"])["width"] == synth.BOMB_SIDE
        with pytest.raises(Image.DecompressionBombError):
            Image.open(io.BytesIO(members["png"]))


def test_corrupt_shard(tmp_path):
    path = tmp_path / "corrupt.tar"
    bad = synth.write_corrupt_shard(path, seed=0)
    assert sorted(bad.values()) == sorted(synth.CORRUPT_KINDS)
    samples = read_samples(path)
    assert len(samples) == 20 + len(synth.CORRUPT_KINDS) and set(bad) <= set(samples)
    for key, members in samples.items():
        assert MEMBER.match(f"{key}.txt") and key.startswith(f"{synth.CORRUPT_SHARD_ID:05d}")
        if key in bad:
            check_bad_sample(bad[key], members)
        else:
            check_sample(key, members, json.loads(members["json"]))
    assert synth.write_corrupt_shard(tmp_path / "again.tar", seed=0) == bad
    assert (tmp_path / "again.tar").read_bytes() == path.read_bytes()


def test_main_writes_shards_and_corrupt_tar(tmp_path, capsys):
    assert synth.main(["--out", str(tmp_path), "--num-shards", "1", "--samples-per-shard", "4", "--corrupt"]) == 0
    names = {p.name for p in tmp_path.iterdir()}
    assert {"00000.tar", "00000.parquet", "00000_stats.json", "corrupt.tar", synth.MARKER_NAME} <= names
    assert "shard 1/1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        synth.main(["--out", str(tmp_path), "--num-shards", "0"])
