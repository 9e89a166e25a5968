"""Plans from manifests: a plain img2dataset folder is planned from its parquet files alone, its
tars read only to decode the planned samples (by offset), with the same result as reading the tars."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from test_job import _same_epoch

from disttrain_api.config import JobConfig
from helpers import jpeg_bytes
from preprocess_service.service.job import Job

SCHEMA = pa.schema([("url", pa.string()), ("caption", pa.string()), ("key", pa.string()), ("status", pa.string()),
                    ("error_message", pa.string()), ("width", pa.int32()), ("height", pa.int32()),
                    ("original_width", pa.int32()), ("original_height", pa.int32())])


def _png(w, h, seed):
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def write_img2dataset(folder, num_shards=3, rows=24, seed=0, extra_column=None, encode_format="jpg"):
    """img2dataset's webdataset output: per shard a tar (jpg, txt, json per success) and a parquet
    with a row per URL tried (every 7th failed). Returns {shard tar: successful keys}."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    out = {}
    for shard in range(num_shards):
        records, keys = [], []
        tar = folder / f"{shard:05d}.tar"
        with wds.TarWriter(str(tar)) as writer:
            for i in range(rows):
                key = f"{shard:05d}{i:04d}"
                caption = "a photo of " + "word " * int(rng.integers(1, 60)) + ("café" if i % 3 else "")
                record = {"url": f"https://x/{key}.jpg", "caption": caption, "key": key, "error_message": None}
                if i % 7 == 3:
                    records.append({**record, "status": "failed_to_download", "error_message": "HTTP 404"})
                    continue
                w, h = int(rng.integers(40, 400)), int(rng.integers(40, 400))
                image = jpeg_bytes(w, h, seed=i) if encode_format == "jpg" else _png(w, h, i)
                writer.write({"__key__": key, encode_format: image, "txt": caption.encode(),
                              "json": json.dumps({**record, "width": w, "height": h}).encode()})
                records.append({**record, "status": "success", "width": w, "height": h,
                                "original_width": 2 * w, "original_height": 2 * h})
                keys.append(key)
        schema = SCHEMA if extra_column is None else SCHEMA.append(pa.field(extra_column[0], extra_column[1]))
        if extra_column is not None:
            records = [{**r, extra_column[0]: extra_column[2] if r["status"] == "success" else None} for r in records]
        pq.write_table(pa.Table.from_pylist(records, schema=schema), folder / f"{shard:05d}.parquet")
        out[str(tar)] = keys
    return out


def _config(folder, **extra):
    return JobConfig(shards=(str(folder),), seq_len=1024, dp_size=2, num_microbatches=2, max_error_fraction=1.0,
                     **extra)


def _hide_tars(folder):
    for tar in folder.glob("*.tar"):
        os.rename(tar, tar.with_suffix(".hidden"))


def _show_tars(folder):
    for tar in folder.glob("*.hidden"):
        os.rename(tar, tar.with_suffix(".tar"))


@pytest.mark.parametrize("encode_format", ["jpg", "png"])
def test_a_plain_img2dataset_folder_is_planned_from_its_parquet_without_reading_a_tar(tmp_path, encode_format):
    """img2dataset's encode_format may be png or webp: the parquet does not say, the decoder reads it."""
    shards = write_img2dataset(tmp_path / "data", rows=32, encode_format=encode_format)
    from_manifests, from_tars = Job(_config(tmp_path / "data")), Job(_config(tmp_path / "data", manifests="off"))
    assert from_manifests.documents.manifest(next(iter(shards))) is not None
    _hide_tars(tmp_path / "data")  # planning the whole epoch needs no tar
    num_steps = from_manifests.plan_all()
    planned = [(doc.shard, doc.key) for s in range(num_steps) for doc in from_manifests.step_plan(s).documents()]
    assert sorted(planned) == sorted((tar, key) for tar, keys in shards.items() for key in keys)
    assert all(doc.media_bytes is None for s in range(num_steps) for doc in from_manifests.step_plan(s).documents())
    kinds = {r.kind for r in from_manifests.report()["skipped"]}
    assert kinds == {"download_failed"}, kinds  # the failed rows are reported, nothing is lost
    _show_tars(tmp_path / "data")
    # the tars are read to decode the planned samples: the same tensors as planning from the tars
    _same_epoch(from_manifests, from_tars)
    assert not [r for r in from_manifests.report()["skipped"] if r.kind != "download_failed"]


@pytest.mark.parametrize("column", [("num_audio", pa.int64(), 1), ("conversations", pa.string(), "[...]"),
                                    ("num_images", pa.int64(), 2)], ids=["audio", "conversation", "two-images"])
def test_a_richer_parquet_keeps_reading_the_tars(tmp_path, column):
    """A row describing more than one image and a caption is not plain: the shard is read as a tar."""
    shards = write_img2dataset(tmp_path / "data", num_shards=1, extra_column=column)
    job = Job(_config(tmp_path / "data"))
    assert job.documents.manifest(next(iter(shards))) is None
    _hide_tars(tmp_path / "data")
    assert job.plan_all() == 0  # planning needs the (hidden) tar: nothing to plan, the shard reported
    assert {r.kind for r in job.report()["skipped"]} >= {"shard_error"}


def test_resume_and_keys_come_from_the_manifest(tmp_path):
    """A restore rebuilds its duplicate-key hashes from the parquet (no tar read) and continues."""
    write_img2dataset(tmp_path / "data", num_shards=4, rows=30)
    config = _config(tmp_path / "data", shuffle_buffer=16, open_shards=2)
    original = Job(config)
    num_steps = original.plan_all()
    want = [[d.key for d in original.step_plan(s).documents()] for s in range(num_steps)]
    middle = num_steps // 2
    for rank in range(config.dp_size):
        original.acknowledge(rank, middle)
    state = json.loads(json.dumps(original.state_dict()))
    resumed = Job(config)
    _hide_tars(tmp_path / "data")
    resumed.load_state_dict(state)
    assert [[d.key for d in resumed.step_plan(s).documents()] for s in range(middle, num_steps)] == want[middle:]
