"""Tests for preprocess_service.adapters.io.img2dataset: manifests from img2dataset's NNNNN.parquet
(successful and failed rows), parquet files that cannot be used (never fatal), bounds and caching."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from disttrain_api.errors import SampleError
from helpers import write_tiny_shards
from preprocess_service.adapters.io import img2dataset
from preprocess_service.adapters.io.img2dataset import (
    MAX_FAILED_ROWS,
    MAX_TEXT_CHARS,
    MISSING,
    failed_rows_as_errors,
    read_manifest,
)
from preprocess_service.service.report import SkippedRecord

# img2dataset's webdataset output: one row per URL it tried (writer.py's schema, less exif/sha256's content)
SCHEMA = pa.schema([
    ("url", pa.string()), ("caption", pa.string()), ("key", pa.string()), ("status", pa.string()),
    ("error_message", pa.string()), ("width", pa.int32()), ("height", pa.int32()),
    ("original_width", pa.int32()), ("original_height", pa.int32()), ("exif", pa.string()), ("sha256", pa.string()),
])


def row(index: int, status: str = "success", caption: str | None = None, error: str | None = None) -> dict:
    """A row whose numbers encode its index: width 100 + i, height 200 + i, original x2."""
    ok = status == "success"
    return {"url": f"https://img.example/{index}.jpg", "caption": caption if caption is not None else "c" * index,
            "key": f"00000{index:04d}", "status": status, "error_message": error,
            "width": 100 + index if ok else None, "height": 200 + index if ok else None,
            "original_width": 2 * (100 + index) if ok else None, "original_height": 2 * (200 + index) if ok else None,
            "exif": None, "sha256": "ab" * 32 if ok else None}


def write_parquet(path: Path, rows: list[dict], schema: pa.Schema = SCHEMA) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path.with_suffix(".tar")


@pytest.fixture
def rows() -> list[dict]:
    return [row(0), row(1, caption="Straße über café"), row(2, "failed_to_download", error="HTTP Error 404"),
            row(3), row(4, "failed_to_resize", error="image too small"), row(5)]


def test_manifest_of_successful_and_failed_rows(tmp_path, rows):
    tar = write_parquet(tmp_path / "00000.parquet", rows)
    manifest = read_manifest(tar)
    assert manifest is not None and manifest.parquet == str(tmp_path / "00000.parquet")
    assert manifest.num_samples == 4 and manifest.num_rows == 6
    assert manifest.keys == ("000000000", "000000001", "000000003", "000000005")
    assert manifest.width.tolist() == [100, 101, 103, 105] and manifest.height.tolist() == [200, 201, 203, 205]
    assert manifest.original_width.tolist() == [200, 202, 206, 210]
    assert manifest.caption_chars.tolist() == [0, 16, 3, 5]  # characters, not UTF-8 bytes
    sizes = manifest.sizes("000000003")
    assert (sizes.width, sizes.height, sizes.original_width, sizes.original_height, sizes.caption_chars) == \
        (103, 203, 206, 406, 3)
    assert manifest.sizes("000000002") is None  # failed rows have no sizes
    assert [(f.key, f.status, f.error_message, f.url) for f in manifest.failed] == [
        ("000000002", "failed_to_download", "HTTP Error 404", "https://img.example/2.jpg"),
        ("000000004", "failed_to_resize", "image too small", "https://img.example/4.jpg")]
    assert manifest.num_failed == 2 and not manifest.more_failed


def test_failed_rows_become_download_failed_errors_outside_the_error_tolerance(tmp_path, rows):
    manifest = read_manifest(write_parquet(tmp_path / "00000.parquet", rows))
    errors = failed_rows_as_errors(manifest, "/data/00000.tar")
    assert [(e.key, e.shard, e.kind) for e in errors] == [("000000002", "/data/00000.tar", "download_failed"),
                                                          ("000000004", "/data/00000.tar", "download_failed")]
    assert "HTTP Error 404" in errors[0].reason and "failed_to_download" in errors[0].reason
    assert "https://img.example/2.jpg" in errors[0].reason and "image too small" in errors[1].reason
    assert "download_failed" in SampleError.KINDS and "download_failed" in SampleError.NOT_LOST
    # one report record per failed row and shard, apart from a sample of that key read elsewhere
    record = SkippedRecord(errors[0].key, errors[0].shard, errors[0].reason, errors[0].kind)
    assert record.record_id != errors[0].key


def test_missing_parquet_and_urls_have_no_manifest(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        assert read_manifest(tmp_path / "00000.tar") is None
        assert read_manifest("https://host/data/00000.tar") is None
        assert read_manifest(tmp_path / "notatar.zip") is None
    assert not caplog.records


def test_test_shards_fake_parquet_is_a_warning_not_an_error(tmp_path, caplog):
    paths = write_tiny_shards(tmp_path / "d", num_shards=1, samples_per_shard=2)  # b"PAR1 not a tar PAR1"
    with caplog.at_level(logging.WARNING):
        assert read_manifest(paths[0]) is None
    assert any(str(tmp_path / "d" / "00000.parquet") in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("content", [b"", b"PAR1", b"\x00" * 100, b"PAR1" + os.urandom(300) + b"PAR1"])
def test_garbage_parquet_is_refused(tmp_path, content, caplog):
    (tmp_path / "00000.parquet").write_bytes(content)
    with caplog.at_level(logging.WARNING):
        assert read_manifest(tmp_path / "00000.tar") is None
    assert "00000.parquet" in caplog.text


def test_parquet_without_key_or_status_is_refused(tmp_path, caplog):
    schema = pa.schema([("url", pa.string()), ("caption", pa.string())])
    tar = write_parquet(tmp_path / "00000.parquet", [{"url": "u", "caption": "c"}], schema)
    with caplog.at_level(logging.WARNING):
        assert read_manifest(tar) is None
    assert "no column" in caplog.text and "key" in caplog.text


def test_successful_row_without_key_is_refused(tmp_path, rows, caplog):
    rows[0]["key"] = None
    with caplog.at_level(logging.WARNING):
        assert read_manifest(write_parquet(tmp_path / "00000.parquet", rows)) is None
    assert "no key" in caplog.text


@pytest.mark.parametrize("bound, value, message", [("MAX_PARQUET_BYTES", 100, "bytes, more than 100"),
                                                   ("MAX_ROWS", 5, "6 rows, more than 5"),
                                                   ("MAX_UNCOMPRESSED_BYTES", 10, "uncompressed")])
def test_bounds(tmp_path, rows, monkeypatch, caplog, bound, value, message):
    monkeypatch.setattr(img2dataset, bound, value)
    with caplog.at_level(logging.WARNING):
        assert read_manifest(write_parquet(tmp_path / "00000.parquet", rows)) is None
    assert message in caplog.text


def test_reads_only_the_manifest_columns(tmp_path, rows, monkeypatch):
    big = pa.schema([*SCHEMA, ("similarity", pa.float64()), ("blob", pa.binary())])
    for r in rows:
        r["blob"] = b"\x00" * 4096
    tar = write_parquet(tmp_path / "00000.parquet", rows, big)
    read = []
    original = pq.ParquetFile.iter_batches

    def spy(self, *args, columns=None, **kw):
        read.append(columns)
        return original(self, *args, columns=columns, **kw)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    assert read_manifest(tar).num_samples == 4
    assert read and all(c is not None and "blob" not in c and "similarity" not in c for c in read)


def test_old_integer_keys_and_pandas_float_sizes(tmp_path):
    """Older img2dataset wrote pandas frames: integer keys, float sizes with NaN on failed rows."""
    schema = pa.schema([("key", pa.int64()), ("status", pa.string()), ("width", pa.float64()),
                        ("error_message", pa.string())])
    rows = [{"key": 7, "status": "success", "width": 640.0, "error_message": None},
            {"key": 8, "status": "failed_to_download", "width": float("nan"), "error_message": "timeout"}]
    manifest = read_manifest(write_parquet(tmp_path / "00000.parquet", rows, schema))
    assert manifest.keys == ("000000007",) and manifest.width.tolist() == [640]
    assert manifest.height.tolist() == [MISSING] and manifest.caption_chars.tolist() == [MISSING]
    assert [(f.key, f.error_message, f.url) for f in manifest.failed] == [("000000008", "timeout", "")]


def test_cached_by_path_mtime_and_size(tmp_path, rows, monkeypatch):
    tar = write_parquet(tmp_path / "00000.parquet", rows)
    first = read_manifest(tar)
    loads = []
    original = img2dataset.load
    monkeypatch.setattr(img2dataset, "load", lambda *a, **k: loads.append(a) or original(*a, **k))
    assert read_manifest(tar) is first and not loads
    write_parquet(tmp_path / "00000.parquet", rows[:2])  # rewritten: another size
    assert read_manifest(tar).num_samples == 2 and len(loads) == 1


def test_demo_layout_from_synth(tmp_path):
    from disttrain_tools import synth

    paths = synth.write_dataset(tmp_path, synth.SynthConfig(num_shards=1, samples_per_shard=6))
    manifest = read_manifest(paths[0])
    table = pq.read_table(tmp_path / "00000.parquet")
    assert manifest.keys == tuple(table.column("key").to_pylist()) and not manifest.failed
    assert manifest.caption_chars.tolist() == [len(c or "") for c in table.column("caption").to_pylist()]


def test_a_job_reports_each_failed_download_once_per_epoch_and_goes_on(tmp_path):
    from disttrain_api.config import JobConfig
    from helpers import write_tiny_shards
    from preprocess_service.service.job import Job

    write_tiny_shards(tmp_path, num_shards=2, samples_per_shard=6)
    failed = [row(90 + i, status="failed_to_download", error=f"HTTP 404 number {i}") for i in range(3)]
    write_parquet(tmp_path / "00000.parquet", [row(i) for i in range(6)] + failed)
    job = Job(JobConfig(shards=(str(tmp_path),), seq_len=1024, num_epochs=2, max_consecutive_errors=1))
    steps = job.plan_all()
    planned = sum(len(list(job.step_plan(s).documents())) for s in range(steps))
    assert planned == 2 * 12, "every sample of both epochs; the failed rows count toward no tolerance"
    reported = [r for r in job.report()["skipped"] if r.kind == "download_failed"]
    assert sorted(r.key for r in reported) == [f"00000{90 + i:04d}" for i in range(3)]
    assert all(r.shard.endswith("00000.tar") and "HTTP 404" in r.reason for r in reported)


CLEAN_STATS = {"count": 6, "successes": 6, "failed_to_download": 0, "failed_to_resize": 0, "duration": 1.5,
               "status_dict": {"success": 6}}


@pytest.mark.parametrize("stats, declared", [
    (CLEAN_STATS, True),
    ({k: v for k, v in CLEAN_STATS.items() if k != "status_dict"}, True),
    (CLEAN_STATS | {"failed_to_download": 1, "count": 7}, False),
    (CLEAN_STATS | {"failed_to_resize": 2}, False),
    (CLEAN_STATS | {"status_dict": {"success": 6, "failed_to_download": 3}}, False),
    (CLEAN_STATS | {"count": 9}, False),  # rows neither succeeded nor counted as failed
    ({"count": 6}, False),  # the fields are missing: not certain
    (CLEAN_STATS | {"failed_to_download": "0"}, False),
    (CLEAN_STATS | {"failed_to_download": -1, "count": 5}, False),
    (CLEAN_STATS | {"status_dict": ["success"]}, False),
    ([1, 2], False),
    ("{not json", False),
    ("[" * 100_000, False),  # past the size bound (and deeply nested)
])
def test_a_stats_file_declaring_no_failures_spares_reading_the_parquet(tmp_path, stats, declared):
    import json

    (tmp_path / "00000_stats.json").write_text(stats if isinstance(stats, str) else json.dumps(stats))
    assert img2dataset.declares_no_failures(tmp_path / "00000.tar") is declared


def test_a_stats_file_is_only_read_as_a_regular_file_in_the_shards_folder(tmp_path):
    import json

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "00000_stats.json").write_text(json.dumps(CLEAN_STATS))
    (tmp_path / "00000_stats.json").symlink_to(elsewhere / "00000_stats.json")
    assert not img2dataset.declares_no_failures(tmp_path / "00000.tar")
    os.mkfifo(tmp_path / "00001_stats.json")  # would block a reader that waited on it
    assert not img2dataset.declares_no_failures(tmp_path / "00001.tar")
    assert not img2dataset.declares_no_failures("http://host/00000.tar")
    assert not img2dataset.declares_no_failures(tmp_path / "missing.tar")


def test_a_job_reads_the_parquet_unless_the_stats_declare_no_failures(tmp_path, monkeypatch):
    import json

    from preprocess_service.service.documents import download_failures

    write_tiny_shards(tmp_path, num_shards=2, samples_per_shard=6)
    failed = [row(90 + i, status="failed_to_download", error=f"HTTP 404 number {i}") for i in range(2)]
    write_parquet(tmp_path / "00000.parquet", [row(i) for i in range(6)] + failed)
    write_parquet(tmp_path / "00001.parquet", [row(i) for i in range(6)])
    (tmp_path / "00000_stats.json").write_text(json.dumps(CLEAN_STATS | {"count": 8, "failed_to_download": 2}))
    (tmp_path / "00001_stats.json").write_text(json.dumps(CLEAN_STATS))
    loads = []
    original = img2dataset.load
    monkeypatch.setattr(img2dataset, "load", lambda *a, **k: loads.append(a[0]) or original(*a, **k))
    assert sorted(e.key for e in download_failures(str(tmp_path / "00000.tar"))) == ["000000090", "000000091"]
    assert download_failures(str(tmp_path / "00001.tar")) == []
    assert [Path(p).name for p in loads] == ["00000.parquet"]


# --- a parquet file is untrusted data: whatever is wrong with it, the shard is read without it ---

@pytest.mark.parametrize("column, value", [
    (pa.array([2**60], pa.int64()), MISSING),  # beyond float64's exact integers: a checked cast raised
    (pa.array([2**64 - 1], pa.uint64()), MISSING),
    (pa.array([2**40], pa.int64()), MISSING),  # absurd: width x height would overflow int64
    (pa.array([640], pa.int16()), 640),
    (pa.array([1e300], pa.float64()), MISSING),
])
def test_absurd_sizes_are_missing_not_an_error(tmp_path, column, value):
    table = pa.table({"key": ["000000000"], "status": ["success"], "width": column, "original_width": column})
    pq.write_table(table, tmp_path / "00000.parquet")
    manifest = read_manifest(tmp_path / "00000.tar")
    assert manifest.width.tolist() == [value] and manifest.original_width.tolist() == [value]


def test_a_parquet_with_absurd_sizes_does_not_fail_the_job(tmp_path):
    from disttrain_api.config import JobConfig
    from preprocess_service.service.job import Job

    write_tiny_shards(tmp_path, num_shards=1, samples_per_shard=4)
    rows = [{"key": f"00000{i:04d}", "status": "success", "width": 2**60} for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "00000.parquet")
    job = Job(JobConfig(shards=(str(tmp_path),), seq_len=1024))
    steps = job.plan_all()
    assert sum(len(list(job.step_plan(s).documents())) for s in range(steps)) == 4


def test_any_failure_building_a_manifest_is_a_warning_but_memory_error(tmp_path, rows, monkeypatch, caplog):
    tar = write_parquet(tmp_path / "00000.parquet", rows)

    def broken(*args):
        raise RuntimeError("unexpected")

    monkeypatch.setattr(img2dataset, "_manifest", broken)
    with caplog.at_level(logging.WARNING):
        assert read_manifest(tar) is None
    assert "RuntimeError: unexpected" in caplog.text and "00000.parquet" in caplog.text

    def no_memory(*args):
        raise MemoryError

    monkeypatch.setattr(img2dataset, "_manifest", no_memory)
    write_parquet(tmp_path / "00000.parquet", rows[:3])  # another size: not cached
    with pytest.raises(MemoryError):
        read_manifest(tar)


def test_a_fifo_named_parquet_never_blocks(tmp_path, caplog):
    import threading

    fifo = tmp_path / "00000.parquet"
    os.mkfifo(fifo)
    got = []
    with caplog.at_level(logging.WARNING):
        reader = threading.Thread(target=lambda: got.append(read_manifest(tmp_path / "00000.tar")), daemon=True)
        reader.start()
        reader.join(10)
    if reader.is_alive():  # it blocked in open(): a writer lets it go
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail("reading a FIFO blocked")
    assert got == [None] and "FIFO" in caplog.text


def test_a_link_out_of_the_shards_folder_is_refused(tmp_path, rows, caplog):
    elsewhere = write_parquet(tmp_path / "private" / "secret.parquet", rows)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "00000.parquet").symlink_to(elsewhere.with_suffix(".parquet"))
    with caplog.at_level(logging.WARNING):
        assert read_manifest(tmp_path / "data" / "00000.tar") is None
    assert "outside the shard's folder" in caplog.text
    write_parquet(tmp_path / "data" / "00001.real.parquet", rows)  # a link within the folder is fine
    (tmp_path / "data" / "00001.parquet").symlink_to("00001.real.parquet")
    assert read_manifest(tmp_path / "data" / "00001.tar").num_samples == 4


def test_decoded_size_is_bounded_not_the_files_own(tmp_path, monkeypatch, caplog):
    """A dictionary-encoded column declares little (the dictionary and its indices) and decodes to
    much: the bound counts it expanded, batch by batch, and the file is refused."""
    message = "x" * 1000
    rows = [row(i, "failed_to_download", caption="a cat", error=message) for i in range(2000)]
    tar = write_parquet(tmp_path / "00000.parquet", rows)
    meta = pq.ParquetFile(tmp_path / "00000.parquet").metadata
    declared = sum(meta.row_group(g).column(j).total_uncompressed_size for g in range(meta.num_row_groups)
                   for j in range(meta.row_group(g).num_columns))
    assert declared < 1 << 20 < 2000 * len(message)
    monkeypatch.setattr(img2dataset, "MAX_UNCOMPRESSED_BYTES", 1 << 20)
    monkeypatch.setattr(img2dataset, "BATCH_ROWS", 500)
    with caplog.at_level(logging.WARNING):
        assert read_manifest(tar) is None
    assert "decode to more than 1048576 bytes" in caplog.text and "first 1000 rows" in caplog.text  # of 2000


def test_reported_texts_are_cut(tmp_path, caplog):
    long_row = row(0, "failed_to_download", error="E" * 100_000)
    long_row["url"] = "https://img.example/" + "u" * 100_000
    long_row["key"] = "k" * 100_000
    manifest = read_manifest(write_parquet(tmp_path / "00000.parquet", [long_row, row(1)]))
    (failed,) = manifest.failed
    assert failed.error_message == "E" * MAX_TEXT_CHARS and len(failed.url) == MAX_TEXT_CHARS
    assert failed.key == "k" * MAX_TEXT_CHARS
    (error,) = failed_rows_as_errors(manifest, "/data/00000.tar")
    assert len(error.reason) < 3 * MAX_TEXT_CHARS


def test_failed_rows_are_reported_first_k_then_one_summary(tmp_path):
    more = 3 * MAX_FAILED_ROWS
    messages = ["HTTP Error 404"] * 50 + ["timed out"] * 30 + ["image too small"] * 10 + [f"odd {i}" for i in range(6)]
    rows = [row(i) for i in range(3)] + [row(10 + i, "failed_to_download", error=m) for i, m in enumerate(messages)]
    assert len(messages) == more
    manifest = read_manifest(write_parquet(tmp_path / "00000.parquet", rows))
    assert manifest.num_failed == more and manifest.num_rows == 3 + more and manifest.num_samples == 3
    assert len(manifest.failed) == MAX_FAILED_ROWS
    errors = failed_rows_as_errors(manifest, "/data/00000.tar")
    assert len(errors) == MAX_FAILED_ROWS + 1 and all(e.kind == "download_failed" for e in errors)
    assert [e.key for e in errors[:-1]] == [f"00000{10 + i:04d}" for i in range(MAX_FAILED_ROWS)]
    summary, rest = errors[-1], more - MAX_FAILED_ROWS
    assert summary.key == f"<{rest} more failed downloads>" and summary.shard == "/data/00000.tar"
    # the rest: 18 x 404, 30 x timed out, 10 x too small, 6 odd ones; the three most common named
    assert f"{rest} more rows" in summary.reason
    assert "30 x 'timed out'" in summary.reason and "18 x 'HTTP Error 404'" in summary.reason
    assert "10 x 'image too small'" in summary.reason and "odd" not in summary.reason


def test_a_few_failed_rows_have_no_summary(tmp_path):
    rows = [row(i, "failed_to_download", error="404") for i in range(MAX_FAILED_ROWS)]
    errors = failed_rows_as_errors(read_manifest(write_parquet(tmp_path / "00000.parquet", rows)), "s.tar")
    assert len(errors) == MAX_FAILED_ROWS and not any(e.key.startswith("<") for e in errors)


def test_cache_is_bounded_by_bytes(tmp_path, rows, monkeypatch):
    first = write_parquet(tmp_path / "00000.parquet", rows)
    second = write_parquet(tmp_path / "00001.parquet", rows)
    size = read_manifest(first).nbytes
    monkeypatch.setattr(img2dataset, "CACHE_BYTES", size + size // 2)  # room for one
    loads = []
    original = img2dataset.load
    monkeypatch.setattr(img2dataset, "load", lambda *a, **k: loads.append(a) or original(*a, **k))
    read_manifest(second)
    read_manifest(first)
    assert len(loads) == 2, "the second manifest pushed the first out"
    assert img2dataset._cache_bytes <= size + size // 2


def test_a_job_reads_its_first_manifests_after_its_first_microbatch_not_before(tmp_path):
    """pyarrow's import and first read (~0.2 CPU-s) are kept out of a job's start-up: the manifests
    of the shards its first step read are read once its first microbatch is decoded, and a report
    asked for earlier reads them first, so it is never short of a failure."""
    import time

    from disttrain_api.config import JobConfig
    from helpers import write_tiny_shards
    from preprocess_service.adapters.decode import InlineDecoder
    from preprocess_service.service.job import Job

    write_tiny_shards(tmp_path, num_shards=2, samples_per_shard=6)
    failed = [row(90 + i, status="failed_to_download", error=f"HTTP 404 number {i}") for i in range(3)]
    write_parquet(tmp_path / "00000.parquet", [row(i) for i in range(6)] + failed)

    def failures(job):
        return sorted(r.key for r in job.skips.records() if r.kind == "download_failed")

    want = [f"00000{90 + i:04d}" for i in range(3)]
    job = Job(JobConfig(shards=(str(tmp_path),), seq_len=1024, dp_size=1, num_microbatches=1, shard_shuffle=False))
    plan = job.step_plan(0)
    assert failures(job) == []  # deferred: nothing decoded yet
    job.microbatch(plan, 0, 0, InlineDecoder())
    deadline = time.monotonic() + 30
    while failures(job) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    assert failures(job) == want
    early = Job(JobConfig(shards=(str(tmp_path),), seq_len=1024, dp_size=1, num_microbatches=1, shard_shuffle=False))
    early.step_plan(0)
    assert sorted(r.key for r in early.report()["skipped"] if r.kind == "download_failed") == want
