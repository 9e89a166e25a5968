"""img2dataset output folders as they are: the NNNNN.parquet beside a shard NNNNN.tar.

img2dataset writes, per shard, a parquet file with one row per URL it tried: ``key``, ``status``
("success", "failed_to_download", "failed_to_resize"), ``error_message``, ``url``, ``caption``,
``width``/``height`` (as stored), ``original_width``/``original_height`` (as downloaded), and more.
``read_manifest`` turns it into a Manifest: the successful keys and their sizes (so epoch planning
knows how many samples a shard holds without reading it), how many rows failed, the first
MAX_FAILED_ROWS of them and the most common error messages of the others (reported as
``download_failed`` skips, which lose nothing the tar holds: ``failed_rows_as_errors``). A parquet
file that cannot be used is never fatal, whatever is wrong with it (MemoryError apart): the shard is
read as any tar, with a warning naming the file.

Bounded (a parquet file is data too): it is opened as a regular file only (never a FIFO or a
device), in the shard's own folder (a link to elsewhere is refused); files above MAX_PARQUET_BYTES
or with more than MAX_ROWS rows are refused; only the manifest's columns are read, in batches of
BATCH_ROWS rows with text columns kept dictionary-encoded, and the file is refused once those
columns hold more than MAX_UNCOMPRESSED_BYTES decoded (dictionaries expanded: a small file can
declare little and decode to much). A failed row's key, status, URL and error message are cut to
MAX_TEXT_CHARS characters. Manifests are cached by path, modification time and size (at most
CACHE_ENTRIES of them and about CACHE_BYTES), so asking again costs a ``stat``.
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
from preprocess_service.adapters.io.tarstream import MAX_KEY_CHARS

log = logging.getLogger(__name__)

MAX_PARQUET_BYTES = 256 << 20
"""Larger parquet files are refused (img2dataset writes a few MB per 10,000 rows)."""
MAX_ROWS = 1_000_000
"""Parquet files with more rows are refused (img2dataset's default shard is 10,000 rows)."""
MAX_UNCOMPRESSED_BYTES = 1 << 30
"""Refused above this many bytes in the columns read, as the file declares them uncompressed and as
they decode (dictionaries expanded)."""
BATCH_ROWS = 65_536
"""Rows read at a time; the decoded bound is checked after each batch."""
MAX_TEXT_CHARS = 512
"""A failed row's key, status, URL and error message are cut to this many characters."""
MAX_FAILED_ROWS = 32
"""Failed rows kept (and reported one by one) per shard; the others are counted and summarised."""
COMMON_MESSAGES = 3
"""Most common error messages kept of the failed rows beyond MAX_FAILED_ROWS."""
MAX_SIZE = 2**31 - 1
"""Larger sizes and caption lengths are absurd: MISSING (products of two stay within int64)."""
CACHE_ENTRIES = 4096
CACHE_BYTES = 256 << 20
"""About the most memory the cached manifests take (Manifest.nbytes)."""
SUCCESS = "success"
REQUIRED_COLUMNS = ("key", "status")
SIZE_COLUMNS = ("width", "height", "original_width", "original_height")
FAILURE_COLUMNS = ("error_message", "url")
MULTIMODAL_COLUMNS = ("num_images", "num_audio", "duration", "durations", "order", "generate", "conversations")
"""Columns a richer dataset (disttrain's synth demo) adds: a row with any of them set (num_images
other than 1) describes more than one image and a caption, so its shard is not planned from the
manifest."""
COLUMNS = (*REQUIRED_COLUMNS, *SIZE_COLUMNS, *FAILURE_COLUMNS, "caption", *MULTIMODAL_COLUMNS)
MAX_CAPTION_CHARS = 1 << 16
"""A caption kept for planning is cut here (a sequence cannot hold more text anyway)."""
MISSING = -1
"""A size or caption length the parquet does not give."""


@dataclass(frozen=True, slots=True)
class FailedRow:
    """A URL img2dataset tried and did not write into the tar (texts cut to MAX_TEXT_CHARS)."""

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
    aligned with ``keys`` (MISSING where absent), and its failed rows: ``num_failed`` of them, the
    first MAX_FAILED_ROWS in ``failed``, the most common messages of the others in ``more_failed``."""

    parquet: str
    keys: tuple[str, ...]
    width: np.ndarray
    height: np.ndarray
    original_width: np.ndarray
    original_height: np.ndarray
    caption_chars: np.ndarray
    failed: tuple[FailedRow, ...]
    """The first failed rows (at most MAX_FAILED_ROWS)."""
    num_failed: int
    """All failed rows."""
    more_failed: tuple[tuple[str, int], ...] = ()
    """(error message, rows) of the most common messages among the failed rows not in ``failed``."""
    captions: tuple[str | None, ...] = ()
    """The successful rows' captions (cut to MAX_CAPTION_CHARS), aligned with ``keys``."""
    plain: bool = False
    """Every successful row is one image and a caption, with its stored size (img2dataset's own
    output): the shard can be planned from this manifest alone (``plannable``)."""
    _index: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def num_samples(self) -> int:
        """Successful rows: the samples the tar should hold."""
        return len(self.keys)

    @property
    def num_rows(self) -> int:
        return len(self.keys) + self.num_failed

    @property
    def nbytes(self) -> int:
        """About the memory it takes (keys, their index, sizes and the failed rows kept)."""
        per_key = 160 + 5 * 8  # str, tuple slot and index entry; five int64 sizes
        return (sum(len(k) for k in self.keys) + per_key * len(self.keys) + 400
                + sum(len(c) + 60 for c in self.captions if c is not None)
                + sum(len(r.key) + len(r.status) + len(r.error_message) + len(r.url) + 300 for r in self.failed)
                + sum(len(m) + 100 for m, _ in self.more_failed))

    def __post_init__(self) -> None:
        if not self._index:
            self._index.update((k, i) for i, k in enumerate(self.keys))

    @property
    def plannable(self) -> bool:
        """Whether the shard may be planned from this manifest: plain rows, each with a caption
        and a stored image size, and unique keys a tar member name keeps whole (no "/" or ".",
        where webdataset splits a name; a repeated key would need the tar's order)."""
        return self.plain and bool(self.keys) and len(self._index) == len(self.keys) \
            and bool((self.width > 0).all() and (self.height > 0).all()) \
            and all(0 < len(k) <= MAX_KEY_CHARS and "/" not in k and "." not in k for k in self.keys)

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


MAX_STATS_BYTES = 64 << 10
"""Larger NNNNN_stats.json files are not read (img2dataset writes a few hundred bytes)."""


def declares_no_failures(tar_path: str | os.PathLike) -> bool:
    """True when the ``X_stats.json`` img2dataset wrote beside a local ``X.tar`` says every row of
    its parquet succeeded (count == successes, no failed_to_download or failed_to_resize, no other
    status in status_dict): the parquet then holds no failure to report, and the service need not
    read it (nor import pyarrow). False whenever that is not certain: no such file, a link out of
    the shard's folder, not a regular file, larger than MAX_STATS_BYTES, not JSON, a field missing
    or of the wrong type. The file is data: it is never trusted beyond skipping the report."""
    import json

    from preprocess_service.adapters.io.remote import ShardReadError
    from preprocess_service.adapters.io.schemes.local import open_regular

    path = parquet_of(tar_path)
    if path is None:
        return False
    stats_path = path.with_name(path.name[:-len(".parquet")] + "_stats.json")
    try:
        with open_regular(_in_its_folder(stats_path)) as f:
            raw = f.read(MAX_STATS_BYTES + 1)
        if len(raw) > MAX_STATS_BYTES:
            return False
        stats = json.loads(raw)
    except (OSError, ValueError, ManifestError, ShardReadError, RecursionError):
        return False
    if not isinstance(stats, dict):
        return False
    numbers = [stats.get(k) for k in ("count", "successes", "failed_to_download", "failed_to_resize")]
    if not all(type(n) is int and n >= 0 for n in numbers):
        return False
    count, successes, failed_to_download, failed_to_resize = numbers
    statuses = stats.get("status_dict", {SUCCESS: successes})
    if not isinstance(statuses, dict) or any(type(n) is not int for n in statuses.values()):
        return False
    others = sum(n for status, n in statuses.items() if status != SUCCESS)
    return count == successes and failed_to_download == failed_to_resize == others == 0


_cache: OrderedDict[tuple[str, int, int], Manifest | None] = OrderedDict()
_cache_bytes = 0
_cache_lock = threading.Lock()
_NONE_BYTES = 200
"""What a cached None (a file that cannot be used) counts for."""


def read_manifest(tar_path: str | os.PathLike) -> Manifest | None:
    """The Manifest of a local shard whose sibling parquet exists; None when there is none, or
    (with a warning naming the file) when it cannot be used. Cached by path, mtime and size."""
    global _cache_bytes
    path = parquet_of(tar_path)
    if path is None:
        return None
    try:
        stat = path.stat()
    except (OSError, ValueError):
        return None
    cache_key = (str(path), stat.st_mtime_ns, stat.st_size)
    with _cache_lock:
        if cache_key in _cache:
            _cache.move_to_end(cache_key)
            return _cache[cache_key]
    try:
        manifest: Manifest | None = load(path)
    except ManifestError as exc:
        log.warning("img2dataset parquet %s is not used (the shard is read without it): %s", path, exc)
        manifest = None
    with _cache_lock:
        if cache_key not in _cache:
            _cache[cache_key] = manifest
            _cache_bytes += _entry_bytes(manifest)
        while _cache and (len(_cache) > CACHE_ENTRIES or _cache_bytes > CACHE_BYTES):
            _cache_bytes -= _entry_bytes(_cache.popitem(last=False)[1])
    return manifest


def _entry_bytes(manifest: Manifest | None) -> int:
    return _NONE_BYTES if manifest is None else manifest.nbytes


def load(path: Path, size: int | None = None) -> Manifest:
    """Reads one img2dataset parquet within the bounds. Whatever goes wrong (but MemoryError) is a
    ManifestError saying why it cannot be used. ``size`` is unused (the open file is measured)."""
    try:
        return _load(Path(path))
    except (ManifestError, MemoryError):
        raise
    except Exception as exc:  # not parquet, damaged, unreadable, not a regular file, unexpected content
        raise ManifestError(f"cannot read it as an img2dataset parquet ({type(exc).__name__}: "
                            f"{str(exc)[:200]})") from None


def _load(path: Path) -> Manifest:
    import pyarrow.parquet as pq

    from preprocess_service.adapters.io.schemes.local import open_regular

    real = _in_its_folder(path)
    with open_regular(real) as f:  # never blocks on a FIFO; refuses what is not a regular file
        size = os.fstat(f.fileno()).st_size
        if size > MAX_PARQUET_BYTES:
            raise ManifestError(f"{size} bytes, more than {MAX_PARQUET_BYTES}")
        with pq.ParquetFile(f) as parquet:
            columns, texts = _columns_to_read(parquet)
            metadata = parquet.metadata
        f.seek(0)
        with pq.ParquetFile(f, metadata=metadata, read_dictionary=texts) as parquet:  # texts stay compact
            batches = _read_bounded(parquet, columns)
    return _manifest(str(path), batches)


def _in_its_folder(path: Path) -> str:
    """The real path of ``path``, which must be in the real folder of the shard beside it (a link
    to elsewhere could lead outside the folders the service may read)."""
    real = os.path.realpath(path)
    folder = os.path.realpath(path.parent)
    if os.path.dirname(real) != folder:
        raise ManifestError(f"it is a link to {real[:200]!r}, outside the shard's folder {folder[:200]!r}")
    return real


def _columns_to_read(parquet) -> tuple[list[str], list[str]]:
    """(the manifest's columns this file has, those of them holding text); ManifestError when a
    bound or a required column fails."""
    import pyarrow as pa

    meta = parquet.metadata
    if meta.num_rows > MAX_ROWS:
        raise ManifestError(f"{meta.num_rows} rows, more than {MAX_ROWS}")
    schema = parquet.schema_arrow
    names = set(schema.names)
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise ManifestError(f"no column {missing} (columns: {sorted(names)[:20]})")
    columns = [c for c in COLUMNS if c in names]
    texts = [c for c in columns if pa.types.is_string(schema.field(c).type) or
             pa.types.is_large_string(schema.field(c).type)]
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
    return columns, texts


def _read_bounded(parquet, columns: list[str]) -> list:
    """The record batches of ``columns``, read BATCH_ROWS rows at a time; ManifestError as soon as
    they hold more than MAX_UNCOMPRESSED_BYTES decoded (the file's own sizes may lie)."""
    batches, decoded, rows = [], 0, 0
    for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=columns, use_threads=False):
        decoded += sum(_decoded_bytes(name, column) for name, column in zip(batch.schema.names, batch.columns))
        rows += batch.num_rows
        if decoded > MAX_UNCOMPRESSED_BYTES:
            raise ManifestError(f"its columns {columns} decode to more than {MAX_UNCOMPRESSED_BYTES} bytes "
                                f"(dictionaries expanded) in the first {rows} rows")
        batches.append(batch)
    return batches


def _decoded_bytes(name: str, array) -> int:
    """Bytes ``array`` would take with its dictionary (if any) expanded, plus the dictionary."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not pa.types.is_dictionary(array.type):
        return array.nbytes
    values = array.dictionary.type
    base = array.dictionary.nbytes + array.indices.nbytes
    if pa.types.is_primitive(values) and values.bit_width >= 8:
        return base + len(array) * values.bit_width // 8
    if pa.types.is_string(values) or pa.types.is_large_string(values) or pa.types.is_binary(values) \
            or pa.types.is_large_binary(values):
        lengths = pc.sum(pc.take(pc.binary_length(array.dictionary), array.indices)).as_py() or 0
        return base + 8 * len(array) + lengths
    raise ManifestError(f"column {name!r} holds a dictionary of {values}")


def _manifest(path: str, batches: list) -> Manifest:
    import pyarrow as pa
    import pyarrow.compute as pc

    if not batches:
        empty = np.empty(0, dtype=np.int64)
        return Manifest(parquet=path, keys=(), width=empty, height=empty, original_width=empty,
                        original_height=empty, caption_chars=empty, failed=(), num_failed=0)
    table = pa.Table.from_batches(batches)
    names = table.column_names
    try:
        keys = _strings(_plain(table.column("key")))
        status = _plain(table.column("status"))
        if not (pa.types.is_string(status.type) or pa.types.is_large_string(status.type)):
            raise ValueError(f"type {status.type}")
    except (pa.ArrowException, ValueError) as exc:
        raise ManifestError(f"its key or status column cannot be read as text ({exc})") from None
    ok = pc.fill_null(pc.equal(status, SUCCESS), False).to_numpy(zero_copy_only=False).astype(bool)
    good_keys = tuple(k for k, good in zip(keys, ok) if good)
    if any(k is None for k in good_keys):
        raise ManifestError("a successful row has no key")
    rows = len(ok)
    sizes = {name: _ints(table.column(name) if name in names else None, rows)[ok] for name in SIZE_COLUMNS}
    captions = _plain(table.column("caption")) if "caption" in names else None
    is_text = captions is not None and (pa.types.is_string(captions.type) or pa.types.is_large_string(captions.type))
    chars = _ints(pc.utf8_length(captions) if is_text else None, rows)[ok]
    plain = is_text and bool(pc.all(pc.is_valid(pc.filter(captions, pa.array(ok)))).as_py() or not ok.any())
    for name in MULTIMODAL_COLUMNS:
        if plain and name in names:
            column = pc.filter(_plain(table.column(name)), pa.array(ok))
            if name == "num_images":
                plain = bool(pc.all(pc.or_kleene(pc.is_null(column), pc.equal(column, 1))).as_py() in (True, None))
            else:
                plain = column.null_count == len(column)
    kept_captions = tuple(None if c is None else c[:MAX_CAPTION_CHARS]
                          for c, good in zip(captions.to_pylist(), ok) if good) if is_text else ()
    failed_rows = np.flatnonzero(~ok)
    kept, rest = failed_rows[:MAX_FAILED_ROWS], failed_rows[MAX_FAILED_ROWS:]
    details = {name: _cut_texts(table.column(name), kept) if name in names else [None] * len(kept)
               for name in ("status", *FAILURE_COLUMNS)}
    failed = tuple(FailedRow(_cut(keys[i]), status or "", message or "", url or "")
                   for i, status, message, url in zip(kept, details["status"], details["error_message"],
                                                      details["url"]))
    more = _common_messages(table.column("error_message"), rest) if "error_message" in names and len(rest) else ()
    return Manifest(parquet=path, keys=good_keys, caption_chars=chars, failed=failed,
                    num_failed=len(failed_rows), more_failed=more, captions=kept_captions, plain=plain, **sizes)


def _plain(column):
    """A column with its dictionaries (if any) expanded."""
    import pyarrow as pa

    if not pa.types.is_dictionary(column.type):
        return column
    return pa.chunked_array([chunk.dictionary.take(chunk.indices) for chunk in column.chunks],
                            type=column.type.value_type)


def _cut_texts(column, rows: np.ndarray) -> list[str | None]:
    """The values at ``rows`` as text cut to MAX_TEXT_CHARS (None where null)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    picked = _plain(column.take(pa.array(rows, type=pa.int64())))
    if pa.types.is_string(picked.type) or pa.types.is_large_string(picked.type):
        return pc.utf8_slice_codeunits(picked, 0, MAX_TEXT_CHARS).to_pylist()
    return [None if v is None else _cut(str(v)) for v in picked.to_pylist()]


def _cut(text: str | None) -> str:
    return "" if text is None else text[:MAX_TEXT_CHARS]


def _common_messages(column, rows: np.ndarray) -> tuple[tuple[str, int], ...]:
    """The COMMON_MESSAGES most common error messages at ``rows`` (cut), with their counts."""
    import pyarrow as pa
    import pyarrow.compute as pc

    picked = column.take(pa.array(rows, type=pa.int64()))
    if pa.types.is_dictionary(picked.type):  # cut the few distinct values, not every row
        value_type = picked.type.value_type
        if pa.types.is_string(value_type) or pa.types.is_large_string(value_type):
            picked = pa.chunked_array([pa.DictionaryArray.from_arrays(
                chunk.indices, pc.utf8_slice_codeunits(chunk.dictionary, 0, MAX_TEXT_CHARS))
                for chunk in picked.chunks])
        picked = _plain(picked)
    elif pa.types.is_string(picked.type) or pa.types.is_large_string(picked.type):
        picked = pc.utf8_slice_codeunits(picked, 0, MAX_TEXT_CHARS)
    counts = pc.value_counts(picked).to_pylist()
    counts.sort(key=lambda vc: -vc["counts"])
    return tuple((_cut(str(vc["values"])) if vc["values"] is not None else "", int(vc["counts"]))
                 for vc in counts[:COMMON_MESSAGES])


def _ints(column, rows: int) -> np.ndarray:
    """An integer or float column as int64: MISSING for nulls, NaN, negatives, values above MAX_SIZE
    and columns of another type (or none)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if column is None or not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
        return np.full(rows, MISSING, dtype=np.int64)
    # unchecked: an integer beyond 2**53 loses precision (then is MISSING) instead of raising
    values = pc.fill_null(column.cast(pa.float64(), safe=False), float("nan")).to_numpy()
    valid = np.isfinite(values) & (values >= 0) & (values <= MAX_SIZE)
    return np.where(valid, values, MISSING).astype(np.int64)


def _strings(column) -> list[str | None]:
    """A key column as text: strings as they are, integers as img2dataset's old 9-digit keys."""
    import pyarrow as pa

    if pa.types.is_integer(column.type):
        return [None if v is None else f"{v:09d}" for v in column.to_pylist()]
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return column.to_pylist()
    raise ValueError(f"type {column.type}")


def failed_rows_as_errors(manifest: Manifest, shard_url: str) -> list[SampleError]:
    """``download_failed`` SampleErrors for the failed rows of ``manifest``: one per row kept (the
    first MAX_FAILED_ROWS: key, shard and img2dataset's error message), then, when there are more,
    one for all the others (key ``<N more failed downloads>``, the most common messages in its
    reason), so a shard's report stays small whatever img2dataset's failure rate. They do not
    count toward the job's error tolerance."""
    out = []
    for row in manifest.failed:
        message = row.error_message or "no error message"
        where = f" from {row.url}" if row.url else ""
        out.append(SampleError(row.key, f"img2dataset did not write it ({row.status}{where}: {message})",
                               shard_url, "download_failed"))
    more = manifest.num_failed - len(manifest.failed)
    if more > 0:
        common = ", ".join(f"{n} x {message or 'no error message'!r}" for message, n in manifest.more_failed)
        out.append(SampleError(f"<{more} more failed downloads>",
                               f"img2dataset did not write {more} more rows of {Path(manifest.parquet).name} "
                               f"(most common errors: {common or 'none given'})", shard_url, "download_failed"))
    return out
