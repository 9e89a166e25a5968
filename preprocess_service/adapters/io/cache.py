"""A bounded on-disk cache of remote shards, shared by every job of a server, so that a remote
shard is downloaded once and then read like a local tar (seek for resume cursors, ``pread`` by
the tar-header index for a microbatch's samples) instead of being fetched again per microbatch.

- **Bound**: ``max_bytes`` over whole shards (sizes announced before the download, reserved
  before the first byte is written). To make room, the least recently used shards nobody is
  reading are deleted; a shard being read is pinned (``acquire`` ... ``release``) and never
  evicted. A shard that cannot get room (larger than the whole cache, or the rest is pinned) is
  not cached: its reader streams it (remote.py), and it is fetched again when read again.
  ``max_bytes = 0`` turns caching off.
- **Share**: a caller may name an ``owner`` (a job): what one owner pins (cached shards it is
  reading) and has reserved (its downloads under way) is at most ``owner_share`` of
  ``max_bytes`` (half by default); a download that would take it beyond gets no room and is
  streamed, so no single job can pin the whole cache or keep all of it reserved. Reading a
  shard already cached is never refused. Callers that name no owner are bound by ``max_bytes``
  alone.
- **Once**: the first caller of a URL gets a ``Claim`` and downloads it (to a temp file, renamed
  when complete); others asking for the same URL meanwhile wait for that download, and give up
  with TimeoutError after ``wait_timeout_s`` without progress. A failed download fails its
  waiters with the same error; the next caller tries again (a failure is not remembered). A
  claim always ends: a commit that fails (the local disk, or the cache closed meanwhile) frees
  its room and lets the waiters try themselves.
- **Where**: a directory of its own per cache (``disttrain-shards-*``) under ``parent``
  (default: the system's temp dir), created at the first download and removed when the cache
  is closed or the process exits. Each holds a lock (flock on its ``.lock`` file, which only
  appears already locked: it is created under another name, locked, then renamed) while alive,
  so the directories of processes that died without cleaning up are removed by the next cache
  made under ``parent``, and never one being created.
  Nothing is kept across restarts.
- **Counters** (``stats()``, and the Prometheus metrics in metrics.py): bytes fetched per URL
  (also by readers that stream), hits, misses, shards streamed uncached, evictions, retries,
  resumed and restarted downloads, failed shards.
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from preprocess_service.adapters.infra import metrics
from preprocess_service.adapters.io.config import READER_DEFAULTS

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = READER_DEFAULTS.shard_cache_bytes
"""8 GiB: a few dozen LAION shards of 10,000 samples (200-400 MB each)."""
DEFAULT_OWNER_SHARE = 0.5
"""Most of the cache one owner (a job) may pin or have reserved (``ShardCache.owner_share``)."""
LOCK_NAME = ".lock"
DIR_PREFIX = "disttrain-shards-"
MAX_URLS_COUNTED = 65_536
"""Per-URL byte counts kept (the oldest are dropped beyond it); the totals keep counting."""
EVENTS = ("hit", "miss", "bypass", "eviction", "retry", "resume", "restart", "failure")


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of a cache's counters since it was made (``ShardCache.stats``)."""

    max_bytes: int
    used_bytes: int
    """Bytes of the cached shards plus the room reserved for downloads under way."""
    shards: int
    events: dict[str, int]
    """hit, miss (a download started), bypass (streamed uncached), eviction, retry (an attempt
    failed), resume (a download continued with a Range request), restart (the server ignored
    the range: the bytes already had were fetched again and dropped), failure (a shard failed)."""
    fetched_bytes: dict[str, int] = field(default_factory=dict)
    """Body bytes received per URL (the most recent MAX_URLS_COUNTED URLs)."""
    fetched_total: int = 0


@dataclass(slots=True)
class _Entry:
    path: str
    size: int
    pins: int = 0
    owners: collections.Counter[str] = field(default_factory=collections.Counter)
    """Pins per owner (the pins of callers that named one)."""

    def pin(self, owner: str | None) -> None:
        self.pins += 1
        if owner is not None:
            self.owners[owner] += 1


@dataclass(slots=True)
class _Flight:
    """A download under way; waiters watch ``last_progress``."""

    owner: str | None = None
    reserved: int = 0
    last_progress: float = field(default_factory=time.monotonic)
    done: bool = False
    error: BaseException | None = None


class Claim:
    """The right and duty to download one URL into the cache: ``reserve`` its size, write
    ``temp_path``, then ``commit`` (the shard is then cached and pinned) or ``abandon``."""

    def __init__(self, cache: ShardCache, url: str, flight: _Flight):
        self.cache, self.url, self._flight = cache, url, flight
        self.temp_path: str | None = None

    def reserve(self, size: int) -> bool:
        """Makes room for ``size`` bytes (evicting unpinned shards); False when there is none."""
        return self.cache._reserve(self, size)

    def touch(self) -> None:
        """The download made progress (seen by the callers waiting for it)."""
        self._flight.last_progress = time.monotonic()

    def commit(self) -> str:
        """The completed temp file becomes the cached shard, pinned for this caller. Raises
        OSError when it cannot (the local disk; the cache closed meanwhile): the claim is then
        abandoned, its room freed, and the waiters try themselves."""
        return self.cache._commit(self)

    def abandon(self, error: BaseException | None = None) -> None:
        """Gives the claim up: ``error`` goes to the waiters (None: they try themselves). Does
        nothing once the claim ended (committed, or abandoned before)."""
        self.cache._end(self, error)


class ShardCache:
    """Whole remote shards on local disk, at most ``max_bytes``; thread-safe."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES, parent: str | None = None, *,
                 owner_share: float = DEFAULT_OWNER_SHARE):
        if max_bytes < 0:
            raise ValueError(f"a shard cache's max_bytes must be >= 0, got {max_bytes}")
        if not 0 < owner_share <= 1:
            raise ValueError(f"a shard cache's owner_share must be in (0, 1], got {owner_share}")
        self.max_bytes, self.parent, self.owner_share = max_bytes, parent, owner_share
        self._lock = threading.Condition()
        self._entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()  # LRU first
        self._flights: dict[str, _Flight] = {}
        self._used = 0
        self._dir: str | None = None
        self._closed = False
        self._finalizer: weakref.finalize | None = None
        self._events = dict.fromkeys(EVENTS, 0)
        self._fetched: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._fetched_total = 0
        self._disk_failures = 0
        """Downloads the local disk refused since the last one it took (ShardCache.disk_outage)."""

    # --- reading ------------------------------------------------------------------------------
    def acquire(self, url: str, touch: Callable[[], None] = lambda: None, wait_timeout_s: float = 60.0, *,
                owner: str | None = None) -> str | Claim:
        """The path of ``url``'s cached copy, pinned until ``release(url, owner)``; or a Claim
        when the caller is to download it. While another caller downloads it, waits (calling
        ``touch`` whenever that download progresses) and raises TimeoutError after
        ``wait_timeout_s`` without progress, or that download's error when it fails. ``owner``
        (a job) is whose share (``owner_share``) the pin and the claim's room count against."""
        with self._lock:
            while (flight := self._flights.get(url)) is not None:
                seen = flight.last_progress
                self._lock.wait(min(0.5, wait_timeout_s))
                if flight.done:
                    if flight.error is not None:
                        raise flight.error
                    continue
                if flight.last_progress != seen:
                    touch()
                elif time.monotonic() - flight.last_progress > wait_timeout_s:
                    raise TimeoutError(f"waited {wait_timeout_s:g} s for another reader's download of {url}, "
                                       "which made no progress")
            entry = self._entries.get(url)
            if entry is not None:
                entry.pin(owner)
                self._entries.move_to_end(url)
                self._event("hit")
                return entry.path
            flight = self._flights[url] = _Flight(owner)
            return Claim(self, url, flight)

    def release(self, url: str, owner: str | None = None) -> None:
        """Unpins a path ``acquire`` or ``Claim.commit`` returned (the same ``owner``)."""
        with self._lock:
            entry = self._entries.get(url)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1
                if owner is not None and entry.owners[owner] > 0:
                    entry.owners[owner] -= 1
                    if not entry.owners[owner]:
                        del entry.owners[owner]

    def held(self, owner: str) -> int:
        """Bytes ``owner`` pins (cached shards it reads) or has reserved (its downloads under way)."""
        with self._lock:
            return self._held(owner)

    def _held(self, owner: str) -> int:
        return sum(f.reserved for f in self._flights.values() if f.owner == owner) + \
            sum(e.size for e in self._entries.values() if e.owners[owner])

    # --- counters -----------------------------------------------------------------------------
    def count_fetched(self, url: str, nbytes: int) -> None:
        """``nbytes`` of ``url`` came over the network (cached or streamed)."""
        with self._lock:
            self._fetched[url] = self._fetched.pop(url, 0) + nbytes
            if len(self._fetched) > MAX_URLS_COUNTED:
                self._fetched.popitem(last=False)
            self._fetched_total += nbytes
        metrics.SHARD_FETCHED_BYTES.labels(url.split(":", 1)[0]).inc(nbytes)

    def count(self, event: str) -> None:
        """One ``event`` (EVENTS) happened."""
        with self._lock:
            self._event(event)

    def disk_outage(self, failed: bool) -> int | None:
        """Notes whether a download could be written to the local disk (``failed``: full,
        read-only, removed). Returns what to say of it, once per outage: 0 at the first failure,
        the number of failed downloads at the first success after them, None otherwise."""
        with self._lock:
            if failed:
                self._disk_failures += 1
                return 0 if self._disk_failures == 1 else None
            failures, self._disk_failures = self._disk_failures, 0
            return failures or None

    def _event(self, event: str) -> None:
        self._events[event] += 1
        metrics.SHARD_CACHE_EVENTS.labels(event).inc()

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(max_bytes=self.max_bytes, used_bytes=self._used, shards=len(self._entries),
                              events=dict(self._events), fetched_bytes=dict(self._fetched),
                              fetched_total=self._fetched_total)

    # --- claims -------------------------------------------------------------------------------
    def _reserve(self, claim: Claim, size: int) -> bool:
        with self._lock:
            if self._closed or size > self.max_bytes:
                return False
            owner = claim._flight.owner
            if owner is not None and self._held(owner) + size > self.owner_share * self.max_bytes:
                return False  # this owner's share is taken: streamed
            room = self.max_bytes - self._used
            victims = []
            for url, entry in self._entries.items():  # least recently used first
                if room >= size:
                    break
                if entry.pins == 0:
                    victims.append(url)
                    room += entry.size
            if room < size:
                return False
            try:
                directory = self._directory()
            except OSError as exc:  # the parent cannot hold it: streamed
                log.warning("cannot make a shard cache directory under %s (%s); remote shards are streamed uncached",
                            self.parent or tempfile.gettempdir(), exc)
                return False
            for url in victims:
                self._evict(url)
            name = hashlib.sha256(claim.url.encode()).hexdigest()[:40]
            claim.temp_path = os.path.join(directory, f"{name}.{os.urandom(4).hex()}.part")
            claim._flight.reserved = size
            self._used += size
            metrics.SHARD_CACHE_BYTES.inc(size)
            return True

    def _commit(self, claim: Claim) -> str:
        assert claim.temp_path is not None, "commit without a reservation"
        path = claim.temp_path.rsplit(".", 2)[0] + ".tar"
        try:
            if self._closed:
                raise FileNotFoundError(f"the shard cache was closed while {claim.url} was downloaded")
            size = os.path.getsize(claim.temp_path)
            os.rename(claim.temp_path, path)
        except BaseException as exc:  # the claim ends whatever happened: no waiter waits for it in vain
            self._end(claim, None if isinstance(exc, OSError) else exc)
            raise
        with self._lock:
            flight = claim._flight
            if self._closed:  # closed between the rename and now: its directory is gone or going
                _unlink(path)
                self._release_room(flight)
                self._finish(claim, None)
                raise FileNotFoundError(f"the shard cache was closed while {claim.url} was downloaded")
            self._used += size - flight.reserved
            metrics.SHARD_CACHE_BYTES.inc(size - flight.reserved)
            flight.reserved = 0
            entry = self._entries[claim.url] = _Entry(path, size)
            entry.pin(flight.owner)
            self._finish(claim, None)
        return path

    def _end(self, claim: Claim, error: BaseException | None) -> None:
        if claim._flight.done:
            return
        if claim.temp_path is not None:
            _unlink(claim.temp_path)
        with self._lock:
            self._release_room(claim._flight)
            self._finish(claim, error)

    def _release_room(self, flight: _Flight) -> None:
        self._used -= flight.reserved
        metrics.SHARD_CACHE_BYTES.dec(flight.reserved)
        flight.reserved = 0

    def _finish(self, claim: Claim, error: BaseException | None) -> None:
        if claim._flight.done:  # ended before: the first ending's error stands
            return
        claim._flight.done, claim._flight.error = True, error
        if self._flights.get(claim.url) is claim._flight:
            del self._flights[claim.url]
        self._lock.notify_all()

    def _evict(self, url: str) -> None:
        entry = self._entries.pop(url)
        _unlink(entry.path)
        self._used -= entry.size
        metrics.SHARD_CACHE_BYTES.dec(entry.size)
        self._event("eviction")

    # --- the directory ------------------------------------------------------------------------
    def _directory(self) -> str:
        if self._dir is None:
            parent = self.parent or tempfile.gettempdir()
            os.makedirs(parent, exist_ok=True)
            _remove_dead_caches(parent)
            directory = tempfile.mkdtemp(prefix=DIR_PREFIX, dir=parent)
            try:  # locked before it gets the name another process's _remove_dead_caches looks for
                making = os.path.join(directory, LOCK_NAME + ".new")
                lock_fd = os.open(making, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    os.rename(making, os.path.join(directory, LOCK_NAME))
                except BaseException:
                    os.close(lock_fd)
                    raise
            except BaseException:
                shutil.rmtree(directory, ignore_errors=True)
                raise
            self._dir = directory
            self._finalizer = weakref.finalize(self, _remove_directory, directory, lock_fd, os.getpid())
        return self._dir

    @property
    def directory(self) -> str | None:
        """Where the cached shards are (None until the first download)."""
        return self._dir

    def close(self) -> None:
        """Deletes every cached shard and the directory; later reads stream uncached."""
        with self._lock:
            self._closed = True
            metrics.SHARD_CACHE_BYTES.dec(sum(e.size for e in self._entries.values()))
            self._used -= sum(e.size for e in self._entries.values())
            self._entries.clear()
        if self._finalizer is not None:
            self._finalizer()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_directory(directory: str, lock_fd: int, owner_pid: int) -> None:
    if os.getpid() == owner_pid:  # not a forked child exiting: the directory is its parent's
        shutil.rmtree(directory, ignore_errors=True)
    os.close(lock_fd)


def _remove_dead_caches(parent: str) -> None:
    """Removes the cache directories under ``parent`` whose owner died (nobody holds their lock)."""
    try:
        names = [n for n in os.listdir(parent) if n.startswith(DIR_PREFIX)]
    except OSError:
        return
    for name in names:
        directory = os.path.join(parent, name)
        try:
            fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue  # not ours, or being created right now
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # its process is alive
        shutil.rmtree(directory, ignore_errors=True)
        os.close(fd)
