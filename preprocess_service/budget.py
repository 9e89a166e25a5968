"""One memory budget for everything a server holds for its clients' data.

Charged against it (bytes reserved before they are allocated, returned when freed):
- decode buffers: every shared-memory arena of the decode pool (also while it waits in the free
  list: /dev/shm holds it) and the in-process decoder's buffers;
- prepared microbatch messages waiting in a stream's queue or being handed to gRPC;
- encoded media bytes a job keeps between planning and decoding (optional: when the budget cannot
  take them they are dropped and re-read from the shard when needed).

Admission: every open stream commits what it is expected to hold at most (its queue and the
microbatches it decodes ahead, at the job's largest message); a new stream is admitted only while
the commitments fit in STREAM_SHARE of the budget, else RESOURCE_EXHAUSTED with a retry hint. So
admitted streams do not starve each other, each holding part of what it needs and waiting for the
rest. Kept media, a cache, may use at most CACHE_SHARE and is the first to go. The charges
themselves are a hard ceiling: a buffer that does not fit waits up to ``wait_s`` (less once its
stream is cancelled), then its stream fails RESOURCE_EXHAUSTED and its client resumes it later at
the same position. A message stays charged until gRPC has taken the next one (gRPC
keeps its own copy while it sends). What is not charged is bounded separately: the interpreter and
libraries (a fixed baseline), heap memory glibc keeps after a burst (the server trims it every
5 s), each shard reader's queue (four items, each at most max_sample_bytes) and each decode
worker's scratch memory (one sample's pixels, at most max_source_pixels x 4 bytes). bench/soak.py
measures the whole against the budget.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from preprocess_service.errors import ResourceExhausted


def default_budget_bytes(fraction: float = 0.5) -> int:
    """``fraction`` of the memory this process may use: the cgroup limit (containers) when one is
    set, else physical memory."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = physical
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
        break
    return int(limit * fraction)


STREAM_SHARE = 0.75
CACHE_SHARE = 0.25


class MemoryBudget:
    """A thread-safe byte counter with a ceiling, stream commitments and a capped cache share."""

    def __init__(self, total_bytes: int, *, wait_s: float = 30.0):
        if total_bytes <= 0:
            raise ValueError(f"a memory budget must be positive, got {total_bytes}")
        self.total = int(total_bytes)
        self.wait_s = wait_s
        self._used = 0
        self._peak = 0
        self._committed = 0
        self._cache = 0
        self._cond = threading.Condition()
        self.reclaimable: Callable[[], int] = lambda: 0
        """Bytes charged to idle caches (the decode pool's free arenas) that are given back on demand."""

    @property
    def used(self) -> int:
        return self._used

    @property
    def peak(self) -> int:
        return self._peak

    def try_reserve(self, nbytes: int) -> bool:
        """Reserves ``nbytes`` if they fit now; never waits."""
        with self._cond:
            if self._used + nbytes > self.total:
                return False
            self._take(nbytes)
            return True

    def reserve(self, nbytes: int, *, what: str, stop: threading.Event | None = None) -> None:
        """Reserves ``nbytes``, waiting up to wait_s for room (less if ``stop`` is set);
        ResourceExhausted naming ``what`` otherwise. A request larger than the whole budget fails at once."""
        if nbytes > self.total:
            raise ResourceExhausted(f"{what} needs {nbytes} bytes, more than the server's whole memory budget "
                                    f"({self.total} bytes, memory_budget_bytes)")
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            while self._used + nbytes > self.total:
                left = deadline - time.monotonic()
                if left <= 0 or (stop is not None and stop.is_set()):
                    raise ResourceExhausted(f"the server's memory budget is in use ({self._used} of {self.total} "
                                            f"bytes); {what} needs {nbytes} more", retry_after_s=5.0)
                self._cond.wait(min(left, 0.2))
            self._take(nbytes)

    def _take(self, nbytes: int) -> None:
        self._used += nbytes
        self._peak = max(self._peak, self._used)

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._used -= nbytes
            assert self._used >= 0, "released more than was reserved"
            self._cond.notify_all()

    @property
    def committed(self) -> int:
        return self._committed

    def commit(self, nbytes: int, what: str) -> Callable[[], None]:
        """Admits a stream expected to hold up to ``nbytes``; returns the function that ends its
        commitment. ResourceExhausted while the open streams' commitments leave no room."""
        capacity = int(self.total * STREAM_SHARE)
        if nbytes > capacity:
            raise ResourceExhausted(f"{what} may hold about {nbytes} bytes, more than this server admits for any "
                                    f"stream ({capacity}: {STREAM_SHARE:.0%} of memory_budget_bytes {self.total}); "
                                    "lower prefetch, seq_len or seqs_per_microbatch")
        with self._cond:
            if self._committed + nbytes > capacity:
                raise ResourceExhausted(f"the server's memory budget is committed to open streams ({self._committed} "
                                        f"of {capacity} bytes); {what} needs about {nbytes} (memory_budget_bytes)",
                                        retry_after_s=5.0)
            self._committed += nbytes

        def end() -> None:
            with self._cond:
                self._committed -= nbytes
        return call_once(end)

    def admit(self, nbytes: int, what: str) -> None:
        """ResourceExhausted unless a stream of ``nbytes`` could be admitted now; reserves nothing."""
        capacity = int(self.total * STREAM_SHARE)
        with self._cond:
            room = capacity - self._committed
        if nbytes > room:
            raise ResourceExhausted(f"the server's memory budget has {max(room, 0)} of {capacity} bytes left for "
                                    f"streams; {what} needs about {nbytes} to start (memory_budget_bytes)",
                                    retry_after_s=5.0)

    def try_cache(self, nbytes: int) -> bool:
        """Charges cache bytes (kept media) if they fit in the cache share and the budget; never waits."""
        with self._cond:
            if self._cache + nbytes > self.total * CACHE_SHARE or self._used + nbytes > self.total:
                return False
            self._cache += nbytes
            self._take(nbytes)
            return True

    def release_cache(self, nbytes: int) -> None:
        with self._cond:
            self._cache -= nbytes
        self.release(nbytes)


def call_once(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` made safe to call more than once: a charge is returned exactly once."""
    done = threading.Event()
    lock = threading.Lock()

    def call() -> None:
        with lock:
            if done.is_set():
                return
            done.set()
        fn()
    return call


UNLIMITED = MemoryBudget(1 << 62)
"""For tools and tests that run a job without a server."""
