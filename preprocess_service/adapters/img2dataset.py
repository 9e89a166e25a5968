"""img2dataset output folders as they are: the NNNNN.parquet beside a shard NNNNN.tar.

img2dataset writes, per shard, a parquet file with one row per URL it tried: ``key``, ``status``
("success", "failed_to_download", "failed_to_resize"), ``error_message``, ``url``, ``caption``,
``width``/``height`` (as stored), ``original_width``/``original_height`` (as downloaded), and more.
``read_manifest`` turns it into a Manifest: the successful keys and their sizes (so epoch planning
knows how many samples a shard holds without reading it) and the failed rows (reported as
``download_failed`` skips, which lose nothing the tar holds). A parquet file that cannot be used
is never fatal: the shard is read as any tar, with a warning naming the file.

Bounded (a parquet file is data too): files above MAX_PARQUET_BYTES, with more than MAX_ROWS rows or
more than MAX_UNCOMPRESSED_BYTES in the columns read are refused; only those columns are read.
Manifests are cached by path, modification time and size, so asking again costs a ``stat``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from disttrain_api.errors import SampleError

log = logging.getLogger(__name__)

MAX_PARQUET_BYTES = 256 << 20
"""Larger parquet files are refused (img2dataset writes a few MB per 10,000 rows)."""
MAX_ROWS = 1_000_000
"""Parquet files with more rows are refused (img2dataset's default shard is 10,000 rows)."""
MAX_UNCOMPRESSED_BYTES = 1 << 30
"""Refused above this many bytes in the columns read, decompressed (a parquet file can be a bomb)."""
CACHE_ENTRIES = 4096
SUCCESS = "success"
REQUIRED_COLUMNS = ("key", "status")
SIZE_COLUMNS = ("width", "height", "original_width", "original_height")
FAILURE_COLUMNS = ("error_message", "url")
COLUMNS = (*REQUIRED_COLUMNS, *SIZE_COLUMNS, *FAILURE_COLUMNS, "caption")
MISSING = -1
"""A size or caption length the parquet does not give."""


@dataclass(frozen=True, slots=True)
class FailedRow:
    """A URL img2dataset tried and did not write into the tar."""

    key: str
    status: str
    """img2dataset's status, e.g. failed_to_download, failed_to_resize."""
    error_message: str
    url: str


@dataclass(frozen=True, slots=True)
class SampleSizes:
    """What the parquet says about one successful sample (MISSING where it says nothing)."""

    width: int
    """Stored image width, pixels."""
    height: int
    original_width: int
    """Width of the downloaded image before img2dataset resized it, pixels."""
    original_height: int
    caption_chars: int
    """Caption length in characters."""


@dataclass(frozen=True, slots=True, eq=False)
class Manifest:
    """One shard's img2dataset parquet: successful keys in row order, their sizes as int64 arrays
    aligned with ``keys`` (MISSING where absent), and the failed rows."""

    parquet: str
    keys: tuple[str, ...]
    width: np.ndarray
    height: np.ndarray
    original_width: np.ndarray
    original_height: np.ndarray
    caption_chars: np.ndarray
    failed: tuple[FailedRow, ...]
    _index: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def num_samples(self) -> int:
        """Successful rows: the samples the tar should hold."""
        return len(self.keys)

    @property
    def num_rows(self) -> int:
        return len(self.keys) + len(self.failed)

    def __post_init__(self) -> None:
        if not self._index:
            self._index.update((k, i) for i, k in enumerate(self.keys))

    def sizes(self, key: str) -> SampleSizes | None:
        """The sizes of a successful sample, or None for a key the parquet does not list as one."""
        i = self._index.get(key)
        if i is None:
            return None
        return SampleSizes(int(self.width[i]), int(self.height[i]), int(self.original_width[i]),
                           int(self.original_height[i]), int(self.caption_chars[i]))


class ManifestError(ValueError):
    """The parquet file cannot be used as a manifest (the shard is then read without one)."""


def parquet_of(tar_path: str | os.PathLike) -> Path | None:
    """The img2dataset parquet beside a local ``X.tar`` (``X.parquet``), or None for a URL or a
    name that does not end in .tar."""
    text = os.fspath(tar_path)
    if "://" in text or text.startswith("pipe:") or not text.endswith(".tar"):
        return None
    return Path(text[:-4] + ".parquet")


_cache: OrderedDict[tuple[str, int, int], Manifest | None] = OrderedDict()
_cache_lock = threading.Lock()


def read_manifest(tar_path: str | os.PathLike) -> Manifest | None:
    """The Manifest of a local shard whose sibling parquet exists; None when there is none, or
    (with a warning naming the file) when it cannot be used. Cached by path, mtime and size."""
    path = parquet_of(tar_path)
    if path is None:
        return None
    try:
        stat = path.stat()
    except OSError:
        return None
    cache_key = (str(path), stat.st_mtime_ns, stat.st_size)
    with _cache_lock:
        if cache_key in _cache:
            _cache.move_to_end(cache_key)
            return _cache[cache_key]
    try:
        manifest: Manifest | None = load(path, stat.st_size)
    except ManifestError as exc:
        log.warning("img2dataset parquet %s is not used (the shard is read without it): %s", path, exc)
        manifest = None
    with _cache_lock:
        _cache[cache_key] = manifest
        while len(_cache) > CACHE_ENTRIES:
            _cache.popitem(last=False)
    return manifest


def load(path: Path, size: int | None = None) -> Manifest:
    """Reads one img2dataset parquet within the bounds; ManifestError says why it cannot be used."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    size = path.stat().st_size if size is None else size
    if size > MAX_PARQUET_BYTES:
        raise ManifestError(f"{size} bytes, more than {MAX_PARQUET_BYTES}")
    try:
        with pq.ParquetFile(path) as parquet:
            columns = _columns_to_read(parquet)
            table = parquet.read(columns=columns)
    except (OSError, pa.ArrowException, ValueError) as exc:  # not parquet, damaged, unreadable
        raise ManifestError(f"cannot read it as parquet ({type(exc).__name__}: {str(exc)[:200]})") from None
    return _manifest(str(path), table)


def _columns_to_read(parquet) -> list[str]:
    """The manifest's columns this file has; ManifestError when a bound or a required column fails."""
    meta = parquet.metadata
    if meta.num_rows > MAX_ROWS:
        raise ManifestError(f"{meta.num_rows} rows, more than {MAX_ROWS}")
    names = set(parquet.schema_arrow.names)
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise ManifestError(f"no column {missing} (columns: {sorted(names)[:20]})")
    columns = [c for c in COLUMNS if c in names]
    unpacked = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for j in range(group.num_columns):
            chunk = group.column(j)
            if chunk.path_in_schema in columns:
                unpacked += chunk.total_uncompressed_size
    if unpacked > MAX_UNCOMPRESSED_BYTES:
        raise ManifestError(f"its columns {columns} hold {unpacked} bytes uncompressed, more than "
                            f"{MAX_UNCOMPRESSED_BYTES}")
    return columns


def _manifest(path: str, table) -> Manifest:
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        keys = _strings(table.column("key"))
        status = _strings(table.column("status"))
    except (pa.ArrowException, ValueError) as exc:
        raise ManifestError(f"its key or status column cannot be read as text ({exc})") from None
    ok = np.array([s == SUCCESS for s in status], dtype=bool)
    good_keys = tuple(k for k, good in zip(keys, ok) if good)
    if any(k is None for k in good_keys):
        raise ManifestError("a successful row has no key")
    rows = len(ok)
    sizes = {name: _ints(table.column(name) if name in table.column_names else None, rows)[ok]
             for name in SIZE_COLUMNS}
    captions = table.column("caption") if "caption" in table.column_names else None
    is_text = captions is not None and (pa.types.is_string(captions.type) or pa.types.is_large_string(captions.type))
    chars = _ints(pc.utf8_length(captions) if is_text else None, rows)[ok]
    failed_rows = np.flatnonzero(~ok)
    details = {name: (table.column(name).take(pa.array(failed_rows)).to_pylist()
                      if name in table.column_names and len(failed_rows) else [None] * len(failed_rows))
               for name in FAILURE_COLUMNS}
    failed = tuple(FailedRow(keys[i] or "", status[i] or "", str(message or ""), str(url or ""))
                   for i, message, url in zip(failed_rows, details["error_message"], details["url"]))
    return Manifest(parquet=path, keys=good_keys, caption_chars=chars, failed=failed, **sizes)


def _ints(column, rows: int) -> np.ndarray:
    """An integer or float column as int64: MISSING for nulls, NaN, negatives, absurd values and
    columns of another type (or none)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if column is None or not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
        return np.full(rows, MISSING, dtype=np.int64)
    values = pc.fill_null(column.cast(pa.float64()), float("nan")).to_numpy()
    valid = np.isfinite(values) & (values >= 0) & (values < 2.0**53)
    return np.where(valid, values, MISSING).astype(np.int64)


def _strings(column) -> list[str | None]:
    """A key or status column as text: strings as they are, integers as img2dataset's old
    9-digit keys."""
    import pyarrow as pa

    if pa.types.is_integer(column.type):
        return [None if v is None else f"{v:09d}" for v in column.to_pylist()]
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return column.to_pylist()
    raise ValueError(f"type {column.type}")


def failed_rows_as_errors(manifest: Manifest, shard_url: str) -> list[SampleError]:
    """One ``download_failed`` SampleError per failed row of ``manifest`` (key, shard and
    img2dataset's error message); they do not count toward the job's error tolerance."""
    out = []
    for row in manifest.failed:
        message = row.error_message or "no error message"
        where = f" from {row.url}" if row.url else ""
        out.append(SampleError(row.key, f"img2dataset did not write it ({row.status}{where}: {message})",
                               shard_url, "download_failed"))
    return out
