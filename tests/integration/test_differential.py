"""Differential tests: two routes to the same data must deliver, sample by sample, the same text token
ids, loss mask and labels, positions and modality of every token, media spans within the sample and
media tensors, and skip the same keys for the same (kind, reason). Packing and order may differ
between the routes (another dp size, a format that keys its rows otherwise), so each run is turned
into {key: what the trainer got for it} by one helper (tests/differential.py) and compared by one
``assert_same``, which names the first differing key and field. One test per pair; ``pytest -s``
prints a line per pair (identical, or the largest deviation per media kind). Every pair is exact:
each route decodes the same bytes to the same planned size with the same code, so no tolerance is
owed anywhere, skip reasons included (SampleError leaves a library's object addresses out of them).

1. img2dataset manifests (``manifests="auto"``: planned from the NNNNN.parquet) vs the tars read
   (``"off"``), on original camera JPEGs with EXIF orientations 1-8 and the parquet's stored sizes.
2. The same rows as WebDataset tars, Hugging Face Parquet and LLaVA JSON Lines.
3. One node vs two replicas on one Redis, each rank on another replica.
4. A fixed dp size vs an elastic resume over the same epoch (dp 4 -> 3 -> 6).
5. No plugin vs an identity plugin (its sample hook and its media hook return what they got).
6. Same-host shared memory vs the wire.
7. Resumed mid-step at step k vs uninterrupted.
"""

from __future__ import annotations

import copy
import json
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from differential import assert_same, consume, per_sample, summary

from disttrain_api.config import ImageConfig, JobConfig, PluginConfig
from disttrain_tools import synth
from disttrain_tools.localcluster import LocalRedis
from helpers import install_plugins, jpeg_bytes, video_bytes
from preprocess_service.adapters.io import img2dataset
from preprocess_service.service.server import create_server

SMALL_IMAGES = ImageConfig(max_pixels=64 * 28 * 28)
"""At most 64 tokens an image: small tensors, quick runs."""


def _report(pair: str, deviations: dict[str, float], run) -> None:
    print(f"\ndifferential {pair}: {summary(deviations, run)}")


# --- corpora --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    """Synthetic LAION-style shards with every modality (captions, several images, audio,
    interleaved documents, images to generate, conversations, text only), two videos and the
    corrupt shard (one sample per kind of fault): 52 samples."""
    root = tmp_path_factory.mktemp("mixed")
    synth.write_dataset(root, synth.SynthConfig(
        num_shards=2, samples_per_shard=12, seed=3, audio_share=0.2, interleaved_share=0.15, generate_share=0.15,
        conversation_share=0.15, text_share=0.05, text_words=40, exif_rotated_share=0.2, png_share=0.1,
        webp_share=0.1))
    synth.write_corrupt_shard(root / "corrupt.tar", seed=1)
    with wds.TarWriter(str(root / "video.tar")) as writer:
        for i in range(2):
            writer.write({"__key__": f"video{i:04d}", "mp4": video_bytes(num_frames=24 + 12 * i),
                          "txt": f"a grey clip, number {i}".encode()})
    return root


def _mixed_config(root: Path, **overrides) -> JobConfig:
    fields = dict(shards=(str(root),), seq_len=1024, dp_size=2, num_microbatches=2, seqs_per_microbatch=1, seed=5,
                  image=SMALL_IMAGES)
    return JobConfig(**{**fields, **overrides})


# img2dataset's parquet (its writer's schema; exif as the JSON string it writes)
IMG2DATASET_SCHEMA = pa.schema([
    ("url", pa.string()), ("caption", pa.string()), ("key", pa.string()), ("status", pa.string()),
    ("error_message", pa.string()), ("width", pa.int32()), ("height", pa.int32()),
    ("original_width", pa.int32()), ("original_height", pa.int32()), ("exif", pa.string()), ("sha256", pa.string()),
])


@pytest.fixture(scope="module")
def camera(tmp_path_factory) -> Path:
    """img2dataset output that kept the original camera bytes: two shards of 16 JPEGs carrying EXIF
    orientations 1-8 (twice each), the parquet's width/height the stored size (as img2dataset
    writes it), and two failed downloads per shard that the tar does not hold."""
    import hashlib

    root = tmp_path_factory.mktemp("camera")
    rng = np.random.default_rng(4)
    for shard in range(2):
        rows = []
        with wds.TarWriter(str(root / f"{shard:05d}.tar")) as writer:
            for index in range(16):
                key, orientation = f"{shard:05d}{index:04d}", index % 8 + 1
                width, height = int(rng.integers(60, 260)), int(rng.integers(60, 260))
                data = jpeg_bytes(width, height, seed=100 * shard + index, exif_orientation=orientation)
                row = {"url": f"https://img.example/{key}.jpg", "caption": f"photo {key} turned {orientation}",
                       "key": key, "status": "success", "error_message": None, "width": width, "height": height,
                       "original_width": width, "original_height": height,
                       "exif": json.dumps({"Image Orientation": str(orientation)}),
                       "sha256": hashlib.sha256(data).hexdigest()}
                writer.write({"__key__": key, "jpg": data, "txt": row["caption"].encode(),
                              "json": json.dumps(row).encode()})
                rows.append(row)
        rows += [{"url": f"https://img.example/gone{shard}{i}.jpg", "caption": "never fetched",
                  "key": f"{shard:05d}{16 + i:04d}", "status": "failed_to_download",
                  "error_message": "HTTP Error 404: Not Found", "width": None, "height": None,
                  "original_width": None, "original_height": None, "exif": None, "sha256": None} for i in range(2)]
        pq.write_table(pa.Table.from_pylist(rows, schema=IMG2DATASET_SCHEMA), root / f"{shard:05d}.parquet")
    return root


def _conversation(i: int, images: int) -> list[dict]:
    question = "<image>" * images + f"\nWhat is in picture set {i}?" if images else f"Say something about {i}."
    turns = [{"from": "human", "value": question}, {"from": "gpt", "value": f"Answer number {i}, " * (1 + i % 3)}]
    if i % 5 == 2:
        turns += [{"from": "human", "value": "And then?"}, {"from": "gpt", "value": "Then nothing."}]
    if i == 13:  # a turn of an unknown role: invalid_conversation, whatever the format
        turns[0] = {"from": "narrator", "value": turns[0]["value"]}
    return turns


@pytest.fixture(scope="module")
def formats(tmp_path_factory) -> dict[str, Path]:
    """24 LLaVA-style rows (0-2 images, camera JPEG with EXIF orientation 1-8 and PNG, one or two
    rounds; a truncated JPEG and an unknown role among them) written three times: a WebDataset tar,
    a Hugging Face Parquet file and
    a LLaVA JSON Lines file with its image folder. Row i's key is f"{i:09d}" in the tar and the
    LLaVA file, FOLDER/STEM/{i:09d} in the Parquet file."""
    root = tmp_path_factory.mktemp("formats")
    for name in ("tar", "parquet", "llava/images"):
        (root / name).mkdir(parents=True)
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    columns: dict[str, list] = {"images": [], "conversations": []}
    records = []
    with wds.TarWriter(str(root / "tar" / "00000.tar")) as writer:
        for i in range(24):
            key = f"{i:09d}"
            images = [jpeg_bytes(50 + 7 * i, 40 + 5 * (i % 4), seed=i, fmt="PNG" if j else "JPEG",
                                 exif_orientation=None if j else i % 8 + 1)  # the JPEGs: camera EXIF 1-8
                      for j in range(i % 3)]
            if i == 7:
                images[0] = images[0][: len(images[0]) // 2]  # truncated: no end marker
            names = [f"{'jpg' if j == 0 else f'{j}.png'}" for j in range(len(images))]
            turns = _conversation(i, len(images))
            writer.write({"__key__": key, **dict(zip(names, images)), "json": json.dumps({"conversations": turns})
                          .encode()})
            columns["images"].append([{"bytes": data, "path": None} for data in images])
            columns["conversations"].append(turns)
            paths = []
            for name, data in zip(names, images):
                paths.append(f"{key}.{name}")
                (root / "llava" / "images" / paths[-1]).write_bytes(data)
            records.append({"id": key, **({"image": paths} if paths else {}), "conversations": turns})
    table = pa.table({"images": pa.array(columns["images"], pa.list_(image_type)),
                      "conversations": columns["conversations"]})
    pq.write_table(table, root / "parquet" / "train-00000-of-00001.parquet", row_group_size=8)
    (root / "llava" / "images" / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return {"tar": root / "tar" / "00000.tar", "parquet": root / "parquet" / "train-00000-of-00001.parquet",
            "llava": root / "llava" / "images" / "chat.jsonl"}


# --- services -------------------------------------------------------------------------------------
IDENTITY = textwrap.dedent('''
    from disttrain_api.plugins import Plugin

    class Identity(Plugin):
        """Changes nothing: the sample hook returns the members it got, the media hook the array it
        got. Each call appends a line to params["log"], so the test sees that the hooks ran."""
        media_kinds = ("image", "audio", "gen", "video")

        def _note(self, line):
            with open(self.params["log"], "a") as log:
                log.write(line + "\\n")

        def sample(self, members, ctx):
            self._note(f"sample {ctx.key}")
            return dict(members)

        def media(self, kind, array, ctx):
            self._note(f"media {kind} {ctx.key}")
            return array
''')


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    """The identity plugin installed as an operator would, on the path before any service starts
    (its decode workers and hook workers import it)."""
    site = install_plugins(tmp_path_factory.mktemp("site"), "identity_plugin", IDENTITY, {"identity": "Identity"})
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(site))
        yield site


@pytest.fixture(scope="module")
def node(plugin_site):
    """One service node with one decode worker (so same-host delivery lends its decode buffers)."""
    server, port, servicer = create_server("127.0.0.1:0", decode_workers=1)
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=0).wait()


@pytest.fixture(scope="module")
def baseline(mixed, node):
    """The mixed corpus read once the plain way (one node, dp 2, shared memory): the reference of
    pairs 3, 5, 6 and 7, as (what consume returned, its RunRecord)."""
    got = consume(node[0], _mixed_config(mixed))
    return got, per_sample(got.microbatches, got.skipped)


def _run(address, config, *, key=str, **options):
    """The RunRecord of one whole run (consume's options; ``key`` as per_sample's)."""
    got = consume(address, config, **options)
    return per_sample(got.microbatches, got.skipped, key=key)


# --- 1. manifests ---------------------------------------------------------------------------------
def test_planned_from_img2dataset_manifests_or_from_the_tars_the_same_samples(camera, node):
    address, servicer = node
    base = dict(shards=(str(camera),), seq_len=1024, dp_size=2, num_microbatches=2, seed=5)
    auto, off = JobConfig(manifests="auto", **base), JobConfig(manifests="off", **base)
    from_manifests, from_tars = _run(address, auto), _run(address, off)
    documents = servicer.jobs.get(auto.job_id()).documents
    assert all(documents.manifest(str(camera / f"{s:05d}.tar")) is not None for s in range(2)), \
        "auto must plan these shards from their parquet"
    assert img2dataset.read_manifest(camera / "00000.tar").plannable
    deviations = assert_same(from_manifests, from_tars)
    assert len(from_tars.samples) == 32 and {kinds[0][0] for kinds in from_tars.skipped.values()} == {"download_failed"}
    _report("1 manifests auto vs off (EXIF 1-8)", deviations, from_manifests)


# --- 2. formats -----------------------------------------------------------------------------------
def test_the_same_rows_as_tars_parquet_and_llava_json(formats, node):
    address, _ = node
    runs = {}
    for name, path in formats.items():
        config = JobConfig(shards=(str(path),), seq_len=1024, dp_size=2, num_microbatches=2, seed=5)
        runs[name] = _run(address, config, key=lambda key: key.rsplit("/", 1)[-1])  # Parquet: FOLDER/STEM/ROW
    assert len(runs["tar"].samples) == 22 and set(runs["tar"].skipped) == {f"{7:09d}", f"{13:09d}"}
    for key, record in runs["tar"].samples.items():  # stored landscape; EXIF 5-8 show the JPEG (first image) upright
        if record.media.get("image"):
            height, width = record.media["image"][0][1].shape[:2]
            assert (height > width) == (int(key) % 8 + 1 >= 5), (key, height, width)
    for other in ("parquet", "llava"):
        deviations = assert_same(runs["tar"], runs[other])
        _report(f"2 formats tar vs {other}", deviations, runs["tar"])


# --- 3. replicas ----------------------------------------------------------------------------------
def test_one_node_and_two_replicas_on_redis_deliver_the_same_samples(mixed, baseline, tmp_path):
    config, (_, single) = _mixed_config(mixed), baseline
    with LocalRedis(tmp_path / "redis") as redis_server:
        servers = [create_server("127.0.0.1:0", decode_workers=1, redis_url=redis_server.url,
                                 job_options={"lease_ttl_s": 1.0}) for _ in range(2)]
        try:
            addresses = [f"127.0.0.1:{port}" for _, port, _ in servers]
            replicated = _run(dict(enumerate(addresses)), config)  # rank r on replica r
        finally:
            for server, _, _ in servers:
                server.stop(grace=0).wait()
    deviations = assert_same(single, replicated)
    _report("3 one node vs two replicas", deviations, single)


# --- 4. elastic resume ----------------------------------------------------------------------------
def test_a_fixed_dp_size_and_an_elastic_resume_4_3_6_deliver_the_same_epoch(mixed, node):
    """Checkpoints at steps 2 and 5 of the 7 (dp 4), each rank acknowledging it as a trainer does;
    the next layout's ranks restore rank 0's state. Not at the epoch's end: a checkpoint there
    cannot move to another layout (reported separately)."""
    address, _ = node
    layouts = {dp: _mixed_config(mixed, dp_size=dp, num_microbatches=1, seq_len=512, seed=11) for dp in (4, 3, 6)}
    fixed = consume(address, layouts[4])
    assert max(mb.step for mb in fixed.microbatches) == 6
    microbatches, skipped, states = [], [], None
    for dp, stop in ((4, 2), (3, 5), (6, None)):
        until = None if stop is None else (lambda rank, position, count, stop=stop: position == (stop, 0))
        got = consume(address, layouts[dp], until=until, acknowledge=True,
                      states=None if states is None else {rank: states[0] for rank in range(dp)})
        first = min(mb.step for mb in got.microbatches)
        assert first == (0 if dp == 4 else 2 if dp == 3 else 5), f"dp {dp} started at step {first}"
        assert stop is None or {s["next_step"] for s in got.states.values()} == {stop}
        microbatches, skipped, states = microbatches + got.microbatches, skipped + got.skipped, got.states
    elastic = per_sample(microbatches, skipped)
    deviations = assert_same(per_sample(fixed.microbatches, fixed.skipped), elastic)
    _report("4 dp 4 vs elastic 4 -> 3 -> 6", deviations, elastic)


# --- 5. plugins -----------------------------------------------------------------------------------
def test_an_identity_plugin_changes_nothing(mixed, node, baseline, tmp_path):
    address, servicer = node
    (_, plain), log = baseline, tmp_path / "hooks.log"
    config = _mixed_config(mixed, plugins=(PluginConfig(name="identity", params={"log": str(log)}),))
    hooked = _run(address, config)
    assert servicer.jobs.get(config.job_id()).documents.hooks is not None
    calls = log.read_text().splitlines()
    assert {line.split()[1] for line in calls if line.startswith("sample ")} >= set(plain.samples), \
        "the sample hook saw every delivered sample"
    assert {line.split()[1] for line in calls if line.startswith("media ")} >= {"image", "audio", "gen"}
    deviations = assert_same(plain, hooked)
    _report("5 no plugin vs identity plugin", deviations, plain)


# --- 6. shared memory -----------------------------------------------------------------------------
def test_shared_memory_and_the_wire_deliver_the_same_samples(mixed, node, baseline):
    (by_memory, shared) = baseline
    by_wire = consume(node[0], _mixed_config(mixed), shared_memory=False)
    assert by_memory.num_shared_memory == len(by_memory.microbatches) and by_wire.num_shared_memory == 0
    deviations = assert_same(shared, per_sample(by_wire.microbatches, by_wire.skipped))
    _report("6 shared memory vs the wire", deviations, shared)


# --- 7. resume ------------------------------------------------------------------------------------
def test_a_run_resumed_mid_step_delivers_what_an_uninterrupted_one_does(mixed, node, baseline):
    address, (_, whole), config = node[0], baseline, _mixed_config(mixed)
    head = consume(address, config, until=lambda rank, position, count: count == 3)
    assert all(s["next_step"] == 1 and s["next_microbatch"] == 1 for s in head.states.values()), head.states
    tail = consume(address, config, states=head.states)
    resumed = per_sample(head.microbatches + tail.microbatches, tail.skipped)
    deviations = assert_same(whole, resumed)
    _report("7 resumed mid-step (step 1, microbatch 1) vs uninterrupted", deviations, whole)


# --- the helper itself ------------------------------------------------------------------------------
def test_assert_same_names_the_first_differing_key_and_field(baseline):
    """Each kind of difference, planted in a copy of a run, is caught and named."""
    _, run = baseline
    key = sorted(k for k, r in run.samples.items() if r.media["image"] and r.media["audio"])[0]

    def changed(change):
        other = copy.deepcopy(run)
        change(other.samples[key])
        return other

    def fails(other, *words, tol=None):
        with pytest.raises(AssertionError) as info:
            assert_same(run, other, tol)
        assert all(word in str(info.value) for word in words), str(info.value)

    fails(changed(lambda r: r.arrays["tokens"].__setitem__(3, 7)), repr(key), "tokens", "at 3")
    fails(changed(lambda r: r.arrays["loss_mask"].__setitem__(-2, 1 - r.arrays["loss_mask"][-2])), "loss_mask")
    fails(changed(lambda r: r.media["audio"].__setitem__(0, ((0, 1), r.media["audio"][0][1]))), "audio spans")
    pixel = changed(lambda r: r.media["image"][0][1].__setitem__((0, 0, 0), r.media["image"][0][1][0, 0, 0] ^ 4))
    fails(pixel, repr(key), "image 0 differs by up to 4.0")
    assert assert_same(run, pixel, tol={"image": 4})["image"] == 4.0  # a stated tolerance lets it pass
    fewer = copy.deepcopy(run)
    del fewer.samples[key]
    fails(fewer, "delivered keys differ", repr(key))
    assert assert_same(run, copy.deepcopy(run)) == dict.fromkeys(assert_same(run, run), 0.0)
