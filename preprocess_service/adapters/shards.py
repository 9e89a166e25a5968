"""Shard I/O: open checked shard sources, read their samples within bounds and timeouts, refetch
samples by key; plus the seeded shard order and shuffle buffer.

A ``ShardReader`` carries the operator's limits (tarstream.TarLimits, the read timeout, the
allowed schemes). How each kind of source is opened:

- local files (the names sources.resolve produced): opened non-blocking and checked to be a
  regular file before any read, so a FIFO, a device or a socket fails that shard at once;
- http(s): urllib with a socket timeout, following a redirect only to a URL the same policy
  allows (webdataset's gopen would run ``curl`` in a shell);
- every other scheme (``pipe:``, ``gs:`` ...) only when the operator lists it in
  allowed_shard_schemes, through webdataset's gopen.

Every read runs on a reader thread that hands samples over a small queue: when the shard sends
nothing for ``read_timeout_s`` the consumer reports the shard (``read_timeout``) and goes on, so
a stuck read never holds a lock, a stream or shutdown. Only tar members are read: the
NNNNN.parquet and NNNNN_stats.json files img2dataset writes beside each tar are never opened.
"""

from __future__ import annotations

import functools
import itertools
import os
import queue
import stat
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from disttrain_api.errors import ConfigError, PermissionDenied, SampleError
from preprocess_service.adapters import sources, tarstream
from preprocess_service.adapters.sources import ShardPolicy
from preprocess_service.adapters.tarstream import TarLimits

ProblemSink = Callable[[SampleError], None]
"""Called with a SampleError for every sample or shard problem (key empty when none is known)."""


class ShardReadError(OSError):
    """A shard cannot be opened or read (not a regular file, HTTP error, timeout)."""


@dataclass(frozen=True, slots=True)
class ShardReader:
    """Reads shards within the operator's bounds; shared by every job of a server."""

    limits: TarLimits = field(default_factory=TarLimits)
    policy: ShardPolicy = field(default_factory=ShardPolicy)
    read_timeout_s: float = 60.0
    """Seconds a shard may send nothing before it is reported and abandoned."""

    def expand(self, specs: Iterable[str]) -> list[str]:
        """The checked, normalised shard names of a job's specs (sources.resolve)."""
        return [source.url for source in sources.resolve(list(specs), self.policy)]

    # --- opening ------------------------------------------------------------------------------
    def open(self, url: str):
        """A binary file object for ``url``; ShardReadError when it cannot be opened."""
        source = sources.parse(url)
        sources.check(source, self.policy)  # again at open: a plan or a Redis record is data too
        if source.is_local:
            return open_regular(source.location)
        if source.scheme in ("http", "https"):
            return self._open_http(source.location)
        from webdataset.gopen import gopen  # only schemes the operator enabled get here

        return gopen(source.location, "rb")

    def _open_http(self, url: str):
        opener = urllib.request.build_opener(_CheckedRedirects(self.policy))
        request = urllib.request.Request(url, headers={"User-Agent": "disttrain-preprocess"})
        try:
            return opener.open(request, timeout=self.read_timeout_s)
        except urllib.error.HTTPError as exc:
            raise ShardReadError(f"cannot fetch {url}: HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise ShardReadError(f"cannot fetch {url}: {getattr(exc, 'reason', exc)}") from None

    # --- reading ------------------------------------------------------------------------------
    def iter_shard(self, url: str, on_problem: ProblemSink, start: dict | None = None) -> Iterator[dict]:
        """Raw samples of one shard (``__key__``, ``__url__``, suffix -> bytes; NEXT_OFFSET where
        the next sample starts, for a local uncompressed tar). Problems with a sample or the shard
        go to ``on_problem``; none ends the caller's iteration with an error.

        ``start`` resumes after the first ``start["samples"]`` samples: a local shard seeks to
        ``start["offset"]`` (NEXT_OFFSET of the last sample read; -1: nothing is left), any other
        reads and drops those samples."""
        offset = (start or {}).get("offset")
        skip = int((start or {}).get("samples", 0))
        local = sources.parse(url).is_local
        if offset == -1:
            return
        if not (local and isinstance(offset, int) and offset >= 0):
            offset = None

        def produce(report: ProblemSink):
            with self.open(url) as f:
                if offset is not None:
                    f.seek(offset)
                samples = tarstream.iter_samples(f, url, self.limits, report,
                                                 base_offset=(offset or 0) if local else None)
                if offset is None and skip:
                    samples = itertools.islice(samples, skip, None)
                yield from samples

        yield from self._watched(produce, url, on_problem)

    def _watched(self, produce: Callable[[ProblemSink], Iterator], url: str, on_problem: ProblemSink) -> Iterator:
        """Runs ``produce`` on a reader thread; gives up after read_timeout_s without an item.
        Problems the reader reports travel through the same queue, so ``on_problem`` is only
        ever called on the consumer's thread, in order with the samples."""
        items: queue.Queue = queue.Queue(maxsize=4)
        quit_ = threading.Event()
        done = object()

        def put(item) -> None:
            while not quit_.is_set():
                try:
                    items.put(item, timeout=0.2)
                    return
                except queue.Full:
                    continue

        def run():
            try:
                for item in produce(put):
                    put(item)
                    if quit_.is_set():
                        return
                put(done)
            except BaseException as exc:  # handed over; the consumer decides
                put(exc)

        thread = threading.Thread(target=run, name=f"shard-reader:{url[-40:]}", daemon=True)
        thread.start()
        try:
            while True:
                try:
                    item = items.get(timeout=self.read_timeout_s)
                except queue.Empty:
                    on_problem(SampleError("", f"no data for {self.read_timeout_s:g} s; the shard is abandoned "
                                           "(read_timeout_s)", url, "read_timeout"))
                    return
                if item is done:
                    return
                if isinstance(item, SampleError):
                    on_problem(item)
                    continue
                if isinstance(item, (MemoryError, ImportError)):
                    raise item
                if isinstance(item, BaseException):
                    on_problem(SampleError("", f"shard read error: {type(item).__name__}: {item}", url, "shard_error"))
                    return
                yield item
        finally:
            quit_.set()

    def read_samples(self, url: str, keys: set[str]) -> dict[str, dict]:
        """The raw samples of ``keys`` in one shard, within read_timeout_s. A local tar is read at the
        members' offsets (an index of its headers, cached per file version); other URLs are
        scanned. Keys that cannot be read come back missing: the caller reports them."""
        result: dict[str, dict] = {}

        def produce(report):
            yield self._read_samples(url, keys)

        for found in self._watched(produce, url, lambda problem: None):
            result = found
        return result

    def _read_samples(self, url: str, keys: set[str]) -> dict[str, dict]:
        source = sources.parse(url)
        if not source.is_local:
            return {s["__key__"]: s for s in self._scan(url, keys)}
        sources.check(source, self.policy)
        with open_regular(source.location) as f:
            st = os.fstat(f.fileno())
            index = _tar_index(source.location, st.st_mtime_ns, st.st_size, self.limits)
            found: dict[str, dict] = {}
            for key in keys:
                members = index.get(key)
                if members is not None:
                    sample = {"__key__": key, "__url__": url}
                    for suffix, (offset, size) in members.items():
                        sample[suffix] = os.pread(f.fileno(), size, offset)
                    found[key] = sample
        return found

    def _scan(self, url: str, keys: set[str]) -> Iterator[dict]:
        wanted = set(keys)
        with self.open(url) as f:
            for sample in tarstream.iter_samples(f, url, self.limits, lambda problem: None):
                if sample["__key__"] in wanted:
                    wanted.discard(sample["__key__"])
                    yield sample
                    if not wanted:
                        return


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to a URL the shard policy allows."""

    def __init__(self, policy: ShardPolicy):
        self.policy = policy

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        try:
            sources.check(sources.parse(newurl), self.policy)
        except (ConfigError, PermissionDenied) as exc:
            raise urllib.error.URLError(f"redirect refused: {exc}") from None
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def open_regular(path: str):
    """Opens a local file for reading only if it is a regular file; never blocks on a FIFO."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise ShardReadError(f"cannot open {path}: {exc.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                    else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
            raise ShardReadError(f"{path} is {kind}; only regular files are read as shards")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


@functools.lru_cache(maxsize=16)  # a step draws from a few shards at a time; ~5 MB per 10k-sample shard
def _tar_index(path: str, mtime_ns: int, size: int, limits: TarLimits) -> dict[str, dict[str, tuple[int, int]]]:
    """key -> {member suffix: (data offset, size)} of a local tar (tarstream.index_members).
    ``mtime_ns`` and ``size`` only key the cache: a rewritten file gets a new index."""
    with open_regular(path) as f:
        return tarstream.index_members(f, limits)


DEFAULT_READER = ShardReader()


def expand_shards(specs: Iterable[str], policy: ShardPolicy = ShardPolicy()) -> list[str]:
    """The checked, normalised shard names of ``specs`` under ``policy`` (sources.resolve)."""
    return ShardReader(policy=policy).expand(specs)


def iter_shard(url: str, on_problem: ProblemSink, reader: ShardReader = DEFAULT_READER) -> Iterator[dict]:
    return reader.iter_shard(url, on_problem)
