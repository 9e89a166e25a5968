"""Shard formats besides WebDataset tars, built here at test time: Hugging Face Parquet (image
structs, lists of them, text, conversations) and LLaVA JSON / JSON Lines with an image folder.
Each is planned, decoded and resumed like a tar; bad rows and hostile paths are skipped with a
reason and their key; everything else is planned exactly once."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from disttrain_api.config import DatasetConfig, JobConfig
from disttrain_api.errors import ConfigError
from helpers import check_resumes, jpeg_bytes, write_tiny_shards
from preprocess_service.adapters.decode import InlineDecoder
from preprocess_service.adapters.io import sources
from preprocess_service.adapters.io.shards import ShardReader
from preprocess_service.core.planner import Documents, EpochPlanner
from preprocess_service.service.job import Job

IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
CONFIG = {"seq_len": 2048, "dp_size": 2, "num_microbatches": 2, "shuffle_buffer": 16}


def _planned(job: Job) -> list[str]:
    job.plan_all()
    return sorted(doc.key for step in range(job.num_steps()) for doc in job.step_plan(step).documents())


def _skipped(job: Job) -> dict[str, str]:
    return {r.key: r.kind for r in job.report()["skipped"] if r.key}


def _decode_all(job: Job) -> int:
    images = 0
    for step in range(job.num_steps()):
        plan = job.step_plan(step)
        for rank in range(job.config.dp_size):
            for index in range(plan.num_microbatches):
                arrays = job.microbatch(plan, rank, index, InlineDecoder()).arrays
                images += int(np.asarray(arrays["image_shapes"]).shape[0])
                assert np.asarray(arrays["pixels"]).size > 0 or not np.asarray(arrays["image_shapes"]).size
    return images


def write_parquet(path, rows: int = 30, row_group_size: int = 8):
    image, images, text, turns = [], [], [], []
    for i in range(rows):
        image.append({"bytes": jpeg_bytes(64 + i, 48, seed=i), "path": f"{i}.jpg"})
        images.append([{"bytes": jpeg_bytes(40, 40, seed=100 + i, fmt="PNG"), "path": None}] if i % 3 == 0 else [])
        text.append(f"caption {i} " * (1 + i % 4))
        turns.append([{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": f"thing {i}"}]
                     if i % 2 else None)
    image[5] = {"bytes": None, "path": "elsewhere/5.jpg"}  # a path only: skipped with its reason
    image[7] = {"bytes": b"not an image at all", "path": None}
    table = pa.table({"image": pa.array(image, IMAGE), "images": pa.array(images, pa.list_(IMAGE)),
                      "text": text, "conversations": turns, "score": np.arange(rows, dtype=np.float32)})
    pq.write_table(table, path, row_group_size=row_group_size)
    return [f"{path.parent.name}/{path.stem}/{i:09d}" for i in range(rows) if i not in (5, 7)]


def test_a_hugging_face_parquet_file_is_planned_decoded_and_resumed_like_a_tar(tmp_path):
    good = write_parquet(tmp_path / "train-00000-of-00001.parquet")
    job = Job(JobConfig(shards=(str(tmp_path / "train-00000-of-00001.parquet"),), **CONFIG))
    assert _planned(job) == good
    skipped = _skipped(job)
    prefix = f"{tmp_path.name}/train-00000-of-00001"
    assert skipped == {f"{prefix}/000000005": "empty", f"{prefix}/000000007": "unreadable_image"}
    assert _decode_all(job) > 0
    docs = {doc.key: doc for step in range(job.num_steps()) for doc in job.step_plan(step).documents()}
    assert len(docs[good[3]].images) == 2 and len(docs[good[4]].images) == 1  # a list column adds images
    other = write_parquet(tmp_path / "train-00001-of-00001.parquet", rows=10)  # the same row numbers
    config = JobConfig(shards=(str(tmp_path),), **CONFIG)  # a folder of Parquet files (no tar in it)
    assert _planned(Job(config)) == sorted(good + other)
    reader = ShardReader()

    def make():
        return EpochPlanner(config, reader.expand(config.shards), Documents(reader, job.documents.parse_only))

    def advance(planner):
        plan = planner.next_plan()
        return None if plan is None or plan.epoch else sorted(d.key for d in plan.documents())

    check_resumes(make, advance, at=lambda n: range(1, n))
    url = str(tmp_path / "train-00000-of-00001.parquet")
    assert sorted(reader.read_samples(url, {good[7], f"{prefix}/000000005", "000000009"})) == [good[7]]
    assert list(reader.shard_keys(url, 6)) == good[:6]  # the keys of the samples read: row 5 is not one


def test_an_img2dataset_folder_is_read_as_tars_not_as_its_parquet_manifests(tmp_path):
    write_tiny_shards(tmp_path, num_shards=2, samples_per_shard=4)
    assert list(sources.resolve_names([str(tmp_path)])) == [str(tmp_path / "00000.tar"), str(tmp_path / "00001.tar")]


def _llava_folder(tmp_path):
    (tmp_path / "images" / "coco").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    for i in range(6):
        (tmp_path / "images" / "coco" / f"{i}.jpg").write_bytes(jpeg_bytes(80, 60 + i, seed=i))
    (tmp_path / "outside" / "secret.jpg").write_bytes(jpeg_bytes(30, 30))
    os.symlink(tmp_path / "outside" / "secret.jpg", tmp_path / "images" / "coco" / "link.jpg")
    turns = [{"from": "human", "value": "<image>\nDescribe."}, {"from": "gpt", "value": "A picture."}]
    records = [{"id": f"r{i}", "image": f"coco/{i}.jpg", "conversations": turns} for i in range(6)]
    records += [{"id": "two", "image": ["coco/0.jpg", "coco/1.jpg"],
                 "conversations": [{"from": "human", "value": "<image><image>\nSame?"},
                                   {"from": "gpt", "value": "No."}]},
                {"id": "text-only", "conversations": [{"from": "human", "value": "Hi"},
                                                      {"from": "gpt", "value": "Hello"}]},
                {"id": "missing", "image": "coco/404.jpg", "conversations": turns},
                {"id": "escape", "image": "../outside/secret.jpg", "conversations": turns},
                {"id": "absolute", "image": str(tmp_path / "outside" / "secret.jpg"), "conversations": turns},
                {"id": "linked-out", "image": "coco/link.jpg", "conversations": turns},
                {"id": "video", "video": "clip.mp4", "conversations": turns},
                {"id": "no-turns", "image": "coco/1.jpg"},
                {"id": "r0", "image": "coco/2.jpg", "conversations": turns}]  # a repeated id
    return records


def test_llava_json_and_jsonl_are_read_with_images_beside_them_and_hostile_paths_refused(tmp_path):
    records = _llava_folder(tmp_path)
    (tmp_path / "images" / "llava.json").write_text(json.dumps(records[:10]))
    (tmp_path / "images" / "more.jsonl").write_text("\n".join(json.dumps(r) for r in records[10:]) + "\nnot json\n")
    job = Job(JobConfig(shards=(str(tmp_path / "images" / "llava.json"), str(tmp_path / "images" / "more.jsonl")),
                        **CONFIG))
    assert _planned(job) == sorted([f"r{i}" for i in range(6)] + ["two", "text-only"])
    skipped = _skipped(job)
    assert {k: skipped[k] for k in ("missing", "escape", "absolute", "linked-out", "video", "no-turns", "r0")} == {
        "missing": "unreadable_image", "escape": "unreadable_image", "absolute": "unreadable_image",
        "linked-out": "unreadable_image", "video": "unreadable_video", "no-turns": "invalid_conversation",
        "r0": "duplicate_key"}
    assert f"more.jsonl#{len(records) - 10:09d}" in skipped  # the line that is not JSON, by its place
    assert _decode_all(job) > 0
    docs = {doc.key: doc for step in range(job.num_steps()) for doc in job.step_plan(step).documents()}
    assert len(docs["two"].images) == 2 and not docs["text-only"].images
    text = [s for s in docs["r1"].segments if hasattr(s, "trainable")]
    assert {s.trainable for s in text} == {True, False}  # only the assistant's turn is trained


def test_a_mixture_of_tars_parquet_and_llava(tmp_path):
    write_tiny_shards(tmp_path / "laion", num_shards=1, samples_per_shard=6)
    good = write_parquet(tmp_path / "hf.parquet", rows=12)
    records = _llava_folder(tmp_path / "llava")
    (tmp_path / "llava" / "images" / "data.jsonl").write_text("\n".join(json.dumps(r) for r in records[:6]))
    job = Job(JobConfig(datasets=(DatasetConfig(name="laion", shards=(str(tmp_path / "laion"),)),
                                  DatasetConfig(name="hf", shards=(str(tmp_path / "hf.parquet"),)),
                                  DatasetConfig(name="llava", shards=(str(tmp_path / "llava/images/data.jsonl"),))),
                        mix_epoch="all_exhausted", **CONFIG))
    keys = _planned(job)
    assert set(good) <= set(keys) and {f"r{i}" for i in range(6)} <= set(keys) and "000000000" in keys
    assert f"{tmp_path.name}/hf/000000005" not in keys


def test_a_file_named_as_a_format_must_look_like_it(tmp_path):
    (tmp_path / "fake.parquet").write_bytes(b"hello, this is not parquet" * 30)
    with pytest.raises(ConfigError, match="named as a parquet file but does not start like one"):
        sources.resolve_names([str(tmp_path / "fake.parquet")])
    (tmp_path / "data.bin").write_text(json.dumps([{"id": 1}] * 40))
    with pytest.raises(ConfigError, match=r"is JSON .*\.jsonl"):
        sources.resolve_names([str(tmp_path / "data.bin")])


def test_parquet_row_groups_and_values_are_bounded_before_they_are_used(tmp_path):
    from preprocess_service.adapters.io.tarstream import TarLimits

    write_parquet(tmp_path / "a.parquet", rows=16)
    url = str(tmp_path / "a.parquet")
    problems: list = []
    tight = ShardReader(limits=TarLimits(max_member_bytes=1 << 20, max_sample_bytes=256))  # below any row's size
    assert list(tight.iter_shard(url, problems.append)) == []
    assert len(problems) == 16 and {p.kind for p in problems} == {"oversize"}
    assert "row group" in problems[0].reason  # refused from the footer, not read
    problems.clear()
    small_values = ShardReader(limits=TarLimits(max_member_bytes=600))  # rows read, each image too large
    assert [s["__key__"] for s in small_values.iter_shard(url, problems.append)] == []
    assert {p.kind for p in problems} >= {"oversize"} and len({p.key for p in problems}) == 16


def test_record_offsets_resume_where_reading_stood_and_keys_never_collide_across_files(tmp_path):
    from preprocess_service.adapters.io.formats import format_of
    from preprocess_service.adapters.io.tarstream import TarLimits
    from preprocess_service.core.sample import NEXT_OFFSET

    records = _llava_folder(tmp_path)
    anonymous = [{k: v for k, v in r.items() if k != "id"} for r in records[:6]]
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / "images" / name).write_text("\n".join(json.dumps(r) for r in anonymous))
    job = Job(JobConfig(shards=(str(tmp_path / "images" / "a.jsonl"), str(tmp_path / "images" / "b.jsonl")), **CONFIG))
    keys = _planned(job)
    assert len(keys) == 12 and keys[0] == "a.jsonl#000000000" and "b.jsonl#000000005" in keys  # none dropped
    reader, url = ShardReader(), str(tmp_path / "images" / "a.jsonl")
    first = list(reader.iter_shard(url, print))
    assert [s[NEXT_OFFSET] for s in first] == [1, 2, 3, 4, 5, 6]
    (tmp_path / "images" / "coco" / "1.jpg").unlink()  # a file gone since: the resume starts at the record index
    rest = list(reader.iter_shard(url, print, {"samples": 3, "offset": first[2][NEXT_OFFSET]}))
    assert [s["__key__"] for s in rest] == [s["__key__"] for s in first[3:]]
    parquet = str(tmp_path / "p.parquet")
    good = write_parquet(tmp_path / "p.parquet", rows=20, row_group_size=4)
    read = list(reader.iter_shard(parquet, print))
    assert [s["__key__"] for s in read] == good
    again = list(reader.iter_shard(parquet, print, {"samples": 9, "offset": read[8][NEXT_OFFSET]}))
    assert [s["__key__"] for s in again] == good[9:]
    problems: list = []
    with open(url, "rb") as f:
        remote = list(format_of("x.jsonl").iter_samples(f, url, "https://data.example/images/a.jsonl", TarLimits(),
                                                        problems.append))
    assert remote == [] and len(problems) == 6 and "remote JSON" in problems[0].reason
