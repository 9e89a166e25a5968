"""Plans from manifests: a plain img2dataset folder is planned from its parquet files, its tars read
by offset only for each image's first bytes (its header: size and EXIF orientation, which the
parquet cannot know) and to decode the planned samples, with the same result as reading the tars."""

import dataclasses
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
from preprocess_service.core.sample import ImageRef
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
def test_a_plain_img2dataset_folder_is_planned_from_its_parquet_and_its_images_headers(tmp_path, encode_format):
    """img2dataset's encode_format may be png or webp: the parquet does not say, the tar's index does."""
    shards = write_img2dataset(tmp_path / "data", rows=32, encode_format=encode_format)
    from_manifests, from_tars = Job(_config(tmp_path / "data")), Job(_config(tmp_path / "data", manifests="off"))
    assert from_manifests.documents.manifest(next(iter(shards))) is not None
    num_steps = from_manifests.plan_all()
    planned = [(doc.shard, doc.key) for s in range(num_steps) for doc in from_manifests.step_plan(s).documents()]
    assert sorted(planned) == sorted((tar, key) for tar, keys in shards.items() for key in keys)
    assert all(doc.media_bytes is None for s in range(num_steps) for doc in from_manifests.step_plan(s).documents())
    kinds = {r.kind for r in from_manifests.report()["skipped"]}
    assert kinds == {"download_failed"}, kinds  # the failed rows are reported, nothing is lost
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


def test_resume_and_keys_come_from_the_manifest(tmp_path, monkeypatch):
    """A restore rebuilds its duplicate-key hashes from the parquet (no tar scanned for its keys)
    and continues."""
    from preprocess_service.adapters.io.shards import ShardReader

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
    monkeypatch.setattr(ShardReader, "shard_keys", lambda *a, **k: pytest.fail("a tar was scanned for its keys"))
    resumed.load_state_dict(state)
    assert [[d.key for d in resumed.step_plan(s).documents()] for s in range(middle, num_steps)] == want[middle:]


def _with_app_segment(jpeg: bytes, size: int) -> bytes:
    """``jpeg`` with an APP2 segment of ``size`` bytes (e.g. an ICC profile) right after SOI."""
    segment = b"\xff\xe2" + (size + 2).to_bytes(2, "big") + bytes(size)
    return jpeg[:2] + segment + jpeg[2:]


def write_camera_originals(folder, orientations=range(1, 9)):
    """img2dataset with the original bytes kept (--resize_mode no --disable_all_reencoding): camera
    JPEGs with their EXIF orientation, the parquet's width/height the STORED ones. Row 1 of the
    last shard declares a wrong size, its row 2 a key the tar does not hold, and one photo has
    60 KiB of segments before its frame header (so its header is past the first bytes read)."""
    folder.mkdir(parents=True)
    expected = {}
    for shard in range(2):
        records = []
        with wds.TarWriter(str(folder / f"{shard:05d}.tar")) as writer:
            for i, orientation in enumerate(orientations):
                key, (w, h) = f"{shard:05d}{i:04d}", (300 + 28 * i, 140 + 28 * shard)
                image = jpeg_bytes(w, h, seed=10 * shard + i, exif_orientation=orientation)
                if i == 3:
                    image = _with_app_segment(image, 60_000) + bytes(7)  # and padding after its end
                declared = (w + 40, h) if (shard, i) == (1, 1) else (w, h)
                records.append({"url": f"file://{key}.jpg", "caption": f"photo {key}", "key": key, "status": "success",
                                "error_message": None, "width": declared[0], "height": declared[1],
                                "original_width": w, "original_height": h})
                if (shard, i) == (1, 2):
                    continue  # in the parquet, not in the tar
                writer.write({"__key__": key, "jpg": image, "txt": f"photo {key}".encode(),
                              "json": json.dumps({"key": key, "caption": f"photo {key}"}).encode()})
                expected[key] = (orientation, (h, w) if orientation >= 5 else (w, h))
        pq.write_table(pa.Table.from_pylist(records, schema=SCHEMA), folder / f"{shard:05d}.parquet")
    return expected


def test_camera_originals_keep_their_orientation_and_size_from_their_bytes_when_planned_from_a_manifest(tmp_path):
    """A manifest cannot know an EXIF orientation, nor be trusted with a size: both come from the
    image's header, read by offset at planning. Every photo is planned at its displayed size and
    orientation, a wrong manifest size is noted and overruled, a row the tar lacks is reported;
    and the delivered tensors equal those of planning from the tars (manifests="off")."""
    expected = write_camera_originals(tmp_path / "data")
    config = dataclasses.replace(_config(tmp_path / "data"), seq_len=160)
    from_manifests, from_tars = Job(config), Job(dataclasses.replace(config, manifests="off"))
    assert all(from_manifests.documents.manifest(url) is not None for url in from_manifests.shard_urls)
    images = {}
    for step in range(from_manifests.plan_all()):
        for doc in from_manifests.step_plan(step).documents():
            (image,) = [s for s in doc.segments if isinstance(s, ImageRef)]
            images[doc.key] = image
    assert images.keys() == expected.keys()
    for key, (orientation, displayed_wh) in expected.items():
        image = images[key]
        assert image.orientation == orientation, key
        assert (image.width > image.height) == (displayed_wh[0] > displayed_wh[1]), (key, image)
    assert [k for k, image in images.items() if image.declared_size is not None] == ["000010001"]
    missing = [r for r in from_manifests.report()["skipped"] if r.key == "000010002"]
    assert [r.kind for r in missing] == ["shard_error"] and "does not hold it" in missing[0].reason
    _same_epoch(from_manifests, from_tars)
