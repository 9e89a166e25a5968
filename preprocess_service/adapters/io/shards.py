"""Shard I/O: open checked shard sources, read their samples within bounds and timeouts, refetch
samples by key; plus the seeded shard order and shuffle buffer.

A ``ShardReader`` carries the operator's limits (tarstream.TarLimits, the read timeout, the
allowed schemes, the fetch policy) and the server's cache of remote shards. How each kind of
source is opened:

- local files (the names sources.resolve produced): opened non-blocking and checked to be a
  regular file before any read, so a FIFO, a device or a socket fails that shard at once;
- http(s), and s3:// / gs:// when the operator allows them (remote.py): downloaded once into the
  bounded shard cache (io/cache.py) and then read like a local file, retried and resumed with
  Range requests after a dropped connection, failed when the download falls behind the fetch
  policy's minimum throughput; a shard the cache has no room for (or none left in the reader's
  owner's share of it: ``for_owner``) is streamed;
  redirects are followed only to URLs the same policy allows (webdataset's gopen would run
  ``curl``, ``aws`` or ``gsutil``);
- every other scheme (``pipe:`` ...) only when the operator lists it in allowed_shard_schemes,
  through webdataset's gopen.

Every read runs on a reader thread that hands samples over a small queue: when the shard shows
no progress (no sample, no byte downloaded) for ``read_timeout_s`` the consumer reports the
shard (``read_timeout``) and goes on, so a stuck read never holds a lock, a stream or shutdown.
Only tar members are read: the NNNNN.parquet and NNNNN_stats.json files img2dataset writes
beside each tar are never opened.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from disttrain_api.errors import SampleError
from preprocess_service.adapters.io import formats, schemes, sources, tarstream
from preprocess_service.adapters.io.cache import ShardCache
from preprocess_service.adapters.io.config import READER_DEFAULTS, ReaderConfig
from preprocess_service.adapters.io.remote import FetchPolicy, Opened, ShardReadError
from preprocess_service.adapters.io.schemes.local import open_regular
from preprocess_service.adapters.io.sources import ShardPolicy
from preprocess_service.adapters.io.tarstream import TarLimits
from preprocess_service.core.shardnames import ShardNames

__all__ = ["DEFAULT_READER", "MemberHead", "ProblemSink", "ShardReadError", "ShardReader", "expand_shards",
           "iter_shard", "open_regular"]

ProblemSink = Callable[[SampleError], None]
"""Called with a SampleError for every sample or shard problem (key empty when none is known)."""
Progress = Callable[[], None]
"""Called by a reader whenever it made progress (the watchdog of ``_watched`` sees it)."""


@functools.lru_cache(maxsize=1 << 16)  # asked once per planned document: realpath each time cost more than the rest
def _rereads_cheaply(url: str) -> bool:
    source = sources.parse(url)
    return schemes.scheme_of(source).rereads_cheaply(source)


def _without_problems(items: list, on_problem: ProblemSink) -> Iterator:
    """A hand-over's samples; its problems go to ``on_problem`` in order with them."""
    for item in items:
        if isinstance(item, SampleError):
            on_problem(item)
        else:
            yield item


@dataclass(frozen=True, slots=True)
class MemberHead:
    """What planning reads of one tar member by its offset (``ShardReader.iter_heads``): all of it
    when it is small or when ``head`` must be whole, else its first and last bytes."""

    size: int
    """The member's bytes in all."""
    head: bytes
    """Its first bytes (all of them when ``whole``)."""
    tail: bytes
    """Its last bytes (at most TAIL_BYTES; all of them when ``whole``)."""

    @property
    def whole(self) -> bool:
        return len(self.head) == self.size


TAIL_BYTES = 4096
"""Last bytes of a member read beside its head (an end marker, after trailing padding)."""

READ_BATCH = 16
"""Samples (and problems) a shard's reader thread hands over at once: a hand-over costs a thread
switch, which cost more than the sample when it was one per sample."""


@dataclass(frozen=True, slots=True)
class ShardReader:
    """Reads shards within the operator's bounds; shared by every job of a server."""

    limits: TarLimits = field(default_factory=TarLimits)
    policy: ShardPolicy = field(default_factory=ShardPolicy)
    read_timeout_s: float = READER_DEFAULTS.shard_read_timeout_s
    """Seconds a shard may show no progress before it is reported and abandoned; also the
    timeout of every socket operation of a remote read."""
    fetch: FetchPolicy = field(default_factory=FetchPolicy)
    """Retries, backoff and size bound of remote reads."""
    cache: ShardCache = field(default_factory=ShardCache, compare=False)
    """Remote shards on local disk, shared by every job reading through this reader."""
    owner: str | None = None
    """Whose share of the cache (ShardCache.owner_share) this reader's pins and downloads count
    against: a job's reader is ``for_owner(job id)``; None: bound by the cache's size alone."""

    @classmethod
    def configured(cls, config: ReaderConfig) -> ShardReader:
        """A reader with ``config``'s bounds (its parts' own configs: ShardPolicy, TarLimits,
        FetchPolicy) and a new cache of remote shards: make one per server."""
        policy = ShardPolicy(allowed_schemes=config.allowed_shard_schemes,
                             allowed_prefixes=config.allowed_shard_prefixes, max_shards=config.max_shards)
        limits = TarLimits(max_member_bytes=config.max_member_bytes, max_sample_bytes=config.max_sample_bytes)
        fetch = FetchPolicy(retries=config.shard_fetch_retries, backoff_s=config.shard_fetch_backoff_s,
                            retry_window_s=config.shard_fetch_retry_window_s, max_shard_bytes=config.max_shard_bytes,
                            min_bytes_per_s=config.shard_fetch_min_bytes_per_s)
        return cls(limits=limits, policy=policy, read_timeout_s=config.shard_read_timeout_s, fetch=fetch,
                   cache=ShardCache(config.shard_cache_bytes, config.shard_cache_dir))

    def for_owner(self, owner: str) -> ShardReader:
        """This reader for one owner (a job): the same limits and cache, the owner's share of it."""
        return dataclasses.replace(self, owner=owner)

    def expand(self, specs: Iterable[str]) -> ShardNames:
        """The checked, normalised shard names of a job's specs (sources.resolve_names): a
        sequence that makes a large pattern's names when asked for."""
        return sources.resolve_names(list(specs), self.policy)

    # --- opening ------------------------------------------------------------------------------
    @contextmanager
    def _opened(self, url: str, progress: Progress, start: int = 0) -> Iterator[Opened]:
        """``url`` from byte ``start`` (where its scheme allows it: ``Opened.positioned``)."""
        source = sources.parse(url)
        sources.check(source, self.policy)  # again at open: a plan or a Redis record is data too
        with schemes.scheme_of(source).open(self, source, progress, start) as opened:
            yield opened

    def rereads_cheaply(self, url: str) -> bool:
        """True where a sample read again costs a ``pread`` (a local uncompressed tar), so a job
        need not hold its encoded bytes from planning to decoding. A remote shard (its cached copy
        may be evicted), a compressed one or a program scheme is re-read by fetching or scanning
        it, so holding its bytes is worth their memory."""
        return _rereads_cheaply(url)

    # --- reading ------------------------------------------------------------------------------
    def iter_shard(self, url: str, on_problem: ProblemSink, start: dict | None = None) -> Iterator[dict]:
        """Raw samples of one shard (``__key__``, ``__url__``, suffix -> bytes; NEXT_OFFSET where
        the next sample starts, for an uncompressed tar read from a local file, the cache or a
        remote stream). Problems with a sample or the shard go to ``on_problem``; none ends the
        caller's iteration with an error.

        ``start`` resumes after the first ``start["samples"]`` samples: the shard is read from
        ``start["offset"]`` (NEXT_OFFSET of the last sample read; -1: nothing is left) where the
        source can start there, else those samples are read and dropped."""
        offset = (start or {}).get("offset")
        skip = int((start or {}).get("samples", 0))
        if offset == -1:
            return
        if not (isinstance(offset, int) and offset >= 0):
            offset = None

        fmt = formats.format_of(url)
        if fmt is not None:  # another format (formats/): from the record after the last one read
            def produce_format(report: ProblemSink, progress: Progress):
                with self._format_file(url, fmt, progress) as (f, path):
                    if offset is not None:
                        yield from fmt.iter_samples(f, path, url, self.limits, report, first=offset)
                    else:
                        yield from itertools.islice(fmt.iter_samples(f, path, url, self.limits, report), skip, None)

            yield from self._watched(produce_format, url, on_problem)
            return

        def produce(report: ProblemSink, progress: Progress):
            with self._opened(url, progress, offset or 0) as opened:
                positioned = opened.positioned
                samples = tarstream.iter_samples(opened.file, url, self.limits, report,
                                                 base_offset=(offset or 0) if positioned else None)
                if skip and (offset is None or not positioned):
                    samples = itertools.islice(samples, skip, None)
                yield from samples

        yield from self._watched(produce, url, on_problem)

    def shard_keys(self, url: str, limit: int | None = None) -> Iterator[str]:
        """The keys of the first ``limit`` (None: all) samples ``iter_shard`` yields, in order, from
        the tar's headers alone (members skipped, not read into memory); problems are not reported."""
        fmt = formats.format_of(url)

        def produce(report: ProblemSink, progress: Progress):
            if fmt is not None:
                with self._format_file(url, fmt, progress) as (f, path):
                    yield from fmt.keys(f, path, url, self.limits)
                return
            with self._opened(url, progress) as opened:
                for sample in tarstream.iter_samples(opened.file, url, self.limits, report, keys_only=True):
                    yield sample["__key__"]

        return itertools.islice(self._watched(produce, url, lambda problem: None), limit)

    def _watched(self, produce: Callable[[ProblemSink, Progress], Iterator], url: str,
                 on_problem: ProblemSink) -> Iterator:
        """Runs ``produce`` on a reader thread; gives up after read_timeout_s without an item or
        a progress call. Problems the reader reports travel through the same queue, so
        ``on_problem`` is only ever called on the consumer's thread, in order with the samples."""
        items: queue.Queue = queue.Queue(maxsize=1)  # at most 2 x READ_BATCH samples read ahead per shard
        quit_ = threading.Event()
        done = object()
        last_progress = [time.monotonic()]
        batch: list = []  # items handed over READ_BATCH at a time: one thread switch each, not one per sample
        batch_lock = threading.Lock()

        def progress() -> None:
            last_progress[0] = time.monotonic()

        def hand_over(item) -> None:
            while not quit_.is_set():
                try:
                    items.put(item, timeout=0.2)
                    return
                except queue.Full:
                    continue

        def take() -> list:  # the caller holds batch_lock
            out = batch[:]
            batch.clear()
            return out

        def flush() -> None:
            with batch_lock:
                out = take()
            if out:
                hand_over(out)

        def put(item) -> None:
            with batch_lock:
                batch.append(item)
                full = len(batch) >= READ_BATCH
            if full:
                flush()

        def run():
            try:
                for item in produce(put, progress):
                    put(item)
                    if quit_.is_set():
                        return
                flush()
                hand_over(done)
            except BaseException as exc:  # handed over; the consumer decides
                flush()
                hand_over(exc)

        thread = threading.Thread(target=run, name=f"shard-reader:{url[-40:]}", daemon=True)
        thread.start()
        try:
            while True:
                try:
                    got = items.get(timeout=min(1.0, self.read_timeout_s))
                except queue.Empty:
                    with batch_lock:  # a reader that stalls mid-batch: what it read so far comes first, unless
                        got = take() if items.empty() else []  # a hand-over came meanwhile (it is older)
                    if got:
                        yield from _without_problems(got, on_problem)
                    if time.monotonic() - last_progress[0] < self.read_timeout_s:
                        continue
                    on_problem(SampleError("", f"no data for {self.read_timeout_s:g} s; the shard is abandoned "
                                           "(read_timeout_s)", url, "read_timeout"))
                    return
                progress()
                if got is done:
                    return
                if isinstance(got, (MemoryError, ImportError)):
                    raise got
                if isinstance(got, BaseException):
                    on_problem(SampleError("", f"shard read error: {type(got).__name__}: {got}", url, "shard_error"))
                    return
                yield from _without_problems(got, on_problem)
        finally:
            quit_.set()

    def read_samples(self, url: str, keys: set[str]) -> dict[str, dict]:
        """The raw samples of ``keys`` in one shard, within read_timeout_s. A local tar, or a remote
        one's cached copy, is read at the members' offsets (an index of its headers, cached per
        file version); other sources are scanned. Keys that cannot be read come back missing:
        the caller reports them."""
        result: dict[str, dict] = {}

        def produce(report, progress):
            yield self._read_samples(url, keys, progress)

        for found in self._watched(produce, url, lambda problem: None):
            result = found
        return result

    def iter_heads(self, url: str, keys: Iterable[str], on_problem: ProblemSink, *, head_bytes: int,
                   wanted: Callable[[str], bool], enough: Callable[[bytes], bool]) -> Iterator[tuple[str, dict | None]]:
        """(key, {suffix: MemberHead} of the members ``wanted(suffix)`` accepts) for each of ``keys``
        in order, None for a key the tar does not hold: a local uncompressed tar (or a remote one's
        cached copy) read at its members' offsets (the index of its headers, cached per file version),
        on a reader thread within read_timeout_s like any read. A member's head is its first
        ``head_bytes`` unless ``enough(head)`` says they do not hold what the caller needs (then the
        whole member, within max_member_bytes). A shard that cannot be read so ends the keys with
        one ``shard_error``."""
        def produce(report: ProblemSink, progress: Progress):
            with self._opened(url, progress) as opened:
                if opened.path is None:
                    raise ShardReadError(f"{url} could only be streamed; its members cannot be read by offset")
                st = os.fstat(opened.file.fileno())
                index = _tar_index(opened.path, st.st_mtime_ns, st.st_size, self.limits)
                if not index and st.st_size:
                    raise ShardReadError(f"{url} is not an uncompressed tar; its members cannot be read by offset")
                fd = opened.file.fileno()
                for key in keys:
                    members = index.get(key)
                    if members is None:
                        yield key, None
                        continue
                    yield key, {suffix: _head(fd, offset, size, head_bytes, enough)
                                for suffix, (offset, size) in members.items() if wanted(suffix)}
                    progress()

        return self._watched(produce, url, on_problem)

    @contextmanager
    def _format_file(self, url: str, fmt: formats.Format, progress: Progress):
        """(file, local path) of a shard of another format: the file itself or a remote shard's
        cached copy; a stream (no room in the cache, a program scheme) cannot be read so."""
        with self._opened(url, progress) as opened:
            if opened.path is None:
                raise ShardReadError(f"{url} is a {fmt.name} file, read from a local file or the shard cache only; "
                                     "this one could only be streamed (no room in the shard cache)")
            yield opened.file, opened.path

    def _read_samples(self, url: str, keys: set[str], progress: Progress) -> dict[str, dict]:
        fmt = formats.format_of(url)
        if fmt is not None:
            with self._format_file(url, fmt, progress) as (f, path):
                return fmt.read_samples(f, path, url, keys, self.limits)
        with self._opened(url, progress) as opened:
            if opened.path is None:  # a stream (a program scheme, or the cache had no room for it)
                return {s["__key__"]: s for s in _scan_file(opened.file, url, keys, self.limits)}
            return _read_indexed(opened.file, opened.path, url, keys, self.limits)


def _read_indexed(f, path: str, url: str, keys: set[str], limits: TarLimits) -> dict[str, dict]:
    """``keys`` of a local tar by ``pread`` at its members' offsets; a file that is not an
    uncompressed tar (no index) is scanned instead."""
    st = os.fstat(f.fileno())
    index = _tar_index(path, st.st_mtime_ns, st.st_size, limits)
    if not index and st.st_size:
        f.seek(0)
        return {s["__key__"]: s for s in _scan_file(f, url, keys, limits)}
    found: dict[str, dict] = {}
    for key in keys:
        members = index.get(key)
        if members is not None:
            sample = {"__key__": key, "__url__": url}
            for suffix, (offset, size) in members.items():
                sample[suffix] = os.pread(f.fileno(), size, offset)
            found[key] = sample
    return found


def _head(fd: int, offset: int, size: int, head_bytes: int, enough: Callable[[bytes], bool]) -> MemberHead:
    head = os.pread(fd, min(size, head_bytes), offset)
    if len(head) < size and not enough(head):
        head = os.pread(fd, size, offset)  # the index left out members over max_member_bytes
    if len(head) == size:
        return MemberHead(size, head, head[-TAIL_BYTES:])
    tail_start = max(offset + len(head), offset + size - TAIL_BYTES)
    return MemberHead(size, head, os.pread(fd, offset + size - tail_start, tail_start))


def _scan_file(f, url: str, keys: set[str], limits: TarLimits) -> Iterator[dict]:
    wanted = set(keys)
    for sample in tarstream.iter_samples(f, url, limits, lambda problem: None):
        if sample["__key__"] in wanted:
            wanted.discard(sample["__key__"])
            yield sample
            if not wanted:
                return


INDEX_CACHE_MEMBERS = 1 << 20
"""Tar members whose offsets a process keeps indexed (about 160 bytes each), across its shards."""
INDEX_CACHE_SHARDS = 1024
"""Shards whose indexes a process keeps, at most."""


class _IndexCache:
    """The tar indexes of the shards read lately, least recently used first out, bounded by their
    members (INDEX_CACHE_MEMBERS) rather than a count of shards: a job reads by offset from every
    shard its shuffle draws on (``open_shards``, 16 by default, and the shards whose samples still
    wait in its shuffle buffer), and an index evicted while its shard is still read is built again
    from every header of the tar. Thread-safe; an index is built outside the lock."""

    def __init__(self, max_members: int = INDEX_CACHE_MEMBERS, max_shards: int = INDEX_CACHE_SHARDS):
        self.max_members, self.max_shards = max_members, max_shards
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[tuple, tuple[dict, int]] = collections.OrderedDict()
        self._members = 0
        self.builds = 0
        """Indexes built (misses), for tests and benches."""

    def __call__(self, path: str, mtime_ns: int, size: int, limits: TarLimits) -> dict[str, dict[str, tuple[int, int]]]:
        """key -> {member suffix: (data offset, size)} of a local tar (tarstream.index_members).
        ``mtime_ns`` and ``size`` only key the cache: a rewritten file gets a new index."""
        key = (path, mtime_ns, size, limits)
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                return found[0]
        with open_regular(path) as f:
            index = tarstream.index_members(f, limits)
        members = sum(len(m) for m in index.values()) + 1
        with self._lock:
            self.builds += 1
            if key not in self._entries:
                self._entries[key] = (index, members)
                self._members += members
            while self._entries and (self._members > self.max_members or len(self._entries) > self.max_shards):
                _, (_, evicted) = self._entries.popitem(last=False)
                self._members -= evicted
        return index

    def cache_clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._members = 0


_tar_index = _IndexCache()


DEFAULT_READER = ShardReader()


def expand_shards(specs: Iterable[str], policy: ShardPolicy = ShardPolicy()) -> ShardNames:
    """The checked, normalised shard names of ``specs`` under ``policy`` (sources.resolve)."""
    return ShardReader(policy=policy).expand(specs)


def iter_shard(url: str, on_problem: ProblemSink, reader: ShardReader = DEFAULT_READER) -> Iterator[dict]:
    return reader.iter_shard(url, on_problem)
