"""Tests for disttrain_tools.synth: layout, metadata consistency, determinism, skew, corrupt shard,
audio / interleaved / generation / conversation samples."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import re
import statistics
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import soundfile
from PIL import Image

from disttrain_api.config import ImageConfig
from disttrain_tools import synth
from preprocess_service.adapters.media.parse import parse_document
from preprocess_service.core.sample import TextSegment
from preprocess_service.core.tokenizer import ByteTokenizer

MEMBER = re.compile(r"^(\d{5})(\d{4})\.(?:(\d+)\.)?(jpg|png|webp|flac|wav|mp3|ogg|txt|json)$")
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
    else:
        check_mixed_sample(key, members, meta)


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
    sizes = [Image.open(io.BytesIO(members[name])).size for name in images]
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
    rotated = 0
    for shard, tar_path in enumerate(tars):
        samples = read_samples(tar_path)
        metas = {key: json.loads(members["json"]) for key, members in samples.items()}
        for key, members in samples.items():
            check_sample(key, members, metas[key])
        rotated += sum(
            Image.open(io.BytesIO(m["jpg"])).getexif().get(0x0112) == 6 for m in samples.values() if "jpg" in m
        )
        table = pq.read_table(out / f"{shard:05d}.parquet")
        assert table.num_rows == len(samples)
        assert set(table.column_names) >= {"duration", "durations", "sample_rate", "order", "generate"}
        for row in table.to_pylist():
            meta = metas[row["key"]]
            assert set(meta) - {"images"} <= set(row)
            assert row == {column: meta.get(column) for column in table.column_names}
    assert rotated > 0  # some JPEGs carry EXIF orientation 6


def test_formats_and_utf8(all_metas, dataset):
    _, tars = dataset
    exts = {ext for tar in tars for members in read_samples(tar).values() for ext in members}
    assert {"jpg", "png", "webp", "1.jpg", "txt", "json", "1.txt", *AUDIO_EXTS} <= exts
    assert any(not meta["caption"].isascii() for meta in all_metas)


def test_skew(all_metas):
    assert len(all_metas) == 400
    short_sides = [min(d["width"], d["height"]) for m in all_metas for d in m.get("images", [m]) if d["width"]]
    assert 300 <= statistics.median(short_sides) <= 650
    assert max(short_sides) > 1500
    assert min(short_sides) >= 150 and max(short_sides) <= 3000
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
    assert 0.005 <= shares["conversation"] <= 0.07
    audio = [m for m in all_metas if sample_kind(m) == "audio"]
    assert {m["num_images"] for m in audio} == {0, 1} and {m["num_audio"] for m in audio} == {1, 2}
    assert {len(m["generate"]) == m["num_images"] for m in all_metas if "generate" in m} == {True, False}
    assert any(m["num_audio"] for m in all_metas if sample_kind(m) == "interleaved")
    infos = [soundfile.info(io.BytesIO(data)) for tar in dataset[1] for members in read_samples(tar).values()
             for name, data in members.items() if name.rsplit(".", 1)[-1] in AUDIO_EXTS]
    assert {"PCM_16", "PCM_24"} <= {i.subtype for i in infos if i.format == "WAV"}
    assert {i.channels for i in infos} == {1, 2} and len({i.samplerate for i in infos}) >= 4


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
    config = synth.SynthConfig(num_shards=1, samples_per_shard=16, seed=7, audio_share=0.7,
                               interleaved_share=0.1, generate_share=0.1)
    first_path = synth.write_dataset(tmp_path / "a", config)[0]
    first = first_path.read_bytes()
    exts = {name.rsplit(".", 1)[-1] for members in read_samples(first_path).values() for name in members}
    assert {"mp3", "ogg", "flac", "wav"} <= exts
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
     {"audio_share": 0.5, "interleaved_share": 0.3, "generate_share": 0.3}],
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
