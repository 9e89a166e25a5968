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
keeps its own copy while it sends), or until its stream has nothing else to send.

Fair: charges that wait are served in arrival order. While one waits, nothing behind it and no new
charge takes room first, so a large charge (a decode arena) is not starved by a stream of small
ones that each fit in the room it waits for. A charge whose holder waits for the next one to free
its last (a stream's decode-ahead, a copy into shared memory) would deadlock a strict queue; so when
no charge has been returned for STALL_S while the first waits, the first waiting charge behind it
that fits goes ahead (``bypassed`` counts them), and any room returned after that goes to the
first again. A charge larger than the data room can ever be fails at once with a clear error;
one that waits longer than ``wait_s`` fails RESOURCE_EXHAUSTED and leaves the queue.

Measured on top (``observe``): the budget bounds the service's whole resident memory, not only
what it charges. The server samples the resident memory of its whole process tree (itself, the
fork server, the decode workers: procmem.py) every memory_sample_s; whatever is resident beyond
the charges (the interpreter and libraries, which ``baseline`` records at start, heap glibc keeps
after a burst, gRPC's copies, shard readers' queues, decode workers' scratch, shared-memory
microbatches a client has taken but not yet released) counts as used until the next sample. So
when uncharged memory grows, new charges wait (and the server trims its heap) instead of passing
the budget. Streams and the cache share what is left above the baseline, and charges stop
HEADROOM short of the total; the whole (PSS) may pass the budget by PSS_HEADROOM at most, which
tests/integration/test_memory_e2e.py checks from outside under 16 streams (bench/soak.py over minutes).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from disttrain_api.errors import ConfigError, ResourceExhausted
from preprocess_service.adapters.infra.config import BUDGET_DEFAULTS, BudgetConfig


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
HEADROOM = 0.10
"""With memory measured, charges stop this fraction of the data room short of the budget: memory
nobody charges (decode workers' scratch, gRPC's copies) grows between two samples."""
PSS_HEADROOM = 0.10
"""How far the service's whole PSS (server, fork server, decode workers) may pass the budget, as a
fraction of it. The budget sees the memory only at samples (memory_sample_s apart, a cheap estimate
calibrated against PSS now and then), and memory nobody charges can grow between two of them before
charges wait: HEADROOM absorbs that below the budget, this bounds what it does not.
tests/integration/test_memory_e2e.py holds a server under 16 streams to it, measured from outside."""
STALL_S = 1.0
"""Seconds without a charge returned while the first waiting charge does not fit, after which one
that waits behind it and fits goes ahead (its holder may be what would free the room)."""


@dataclass(eq=False, slots=True)
class _Waiter:
    nbytes: int
    deadline: float
    granted: bool = False


class MemoryBudget:
    """A thread-safe byte counter with a ceiling, stream commitments and a capped cache share."""

    @classmethod
    def configured(cls, config: BudgetConfig) -> MemoryBudget:
        """The budget ``config`` sets (memory_budget_bytes 0: half the machine's or container's memory)."""
        return cls(config.memory_budget_bytes or default_budget_bytes(), wait_s=config.memory_wait_s)

    def __init__(self, total_bytes: int, *, wait_s: float = BUDGET_DEFAULTS.memory_wait_s):
        if total_bytes <= 0:
            raise ValueError(f"a memory budget must be positive, got {total_bytes}")
        self.total = int(total_bytes)
        self.wait_s = wait_s
        self._used = 0
        self._peak = 0
        self._committed = 0
        self._cache = 0
        self._cond = threading.Condition()
        self.baseline = 0
        """Resident bytes of the idle service (set_baseline): not available to streams or the cache."""
        self._uncharged = 0  # resident beyond the charges at the last observe()
        self._ceiling = self.total  # charges stop here: HEADROOM short of the total once memory is measured
        self._resident = 0
        self._resident_peak = 0
        self.reclaimable: Callable[[], int] = lambda: 0
        """Bytes charged to idle caches (the decode pool's free arenas) that are given back on demand."""
        self.on_pressure: Callable[[], None] = lambda: None
        """Called (at most once a second, outside the lock) when a charge must wait while memory
        nobody charged is resident: the server trims its heap."""
        self._last_pressure = 0.0
        self._waiting: deque[_Waiter] = deque()
        self._progress = time.monotonic()  # when room was last returned or given
        self.bypassed = 0
        """Charges that went ahead of the first waiting one because nothing had been returned for STALL_S."""

    @property
    def used(self) -> int:
        """Bytes charged now."""
        return self._used

    @property
    def uncharged(self) -> int:
        """Resident bytes beyond the charges at the last sample (0 until one is observed)."""
        return self._uncharged

    @property
    def resident(self) -> int:
        return self._resident

    @property
    def resident_peak(self) -> int:
        return self._resident_peak

    def set_baseline(self, resident: int) -> None:
        """Records the idle service's resident bytes; ConfigError if they leave too little of the
        budget for data (less than a quarter of it)."""
        if self.total - resident < self.total / 4:
            raise ConfigError(f"memory_budget_bytes {self.total} leaves too little for data: the idle service "
                              f"already holds {resident} bytes (its interpreter, libraries and decode workers); "
                              f"raise it to at least {resident * 4 // 3 + 1}")
        with self._cond:
            self.baseline = int(resident)
            self._ceiling = self.total - int(HEADROOM * self.data_total)
        self.observe(resident)

    def observe(self, resident: int) -> None:
        """Counts what the service holds beyond its charges (a sample of its resident memory) as
        used until the next sample."""
        with self._cond:
            before = self._in_use()
            self._resident = int(resident)
            self._resident_peak = max(self._resident_peak, self._resident)
            self._uncharged = max(0, self._resident - self._used)
            if self._in_use() < before:
                self._progress = time.monotonic()
            self._serve()

    def _in_use(self) -> int:
        return self._used + self._uncharged

    @property
    def data_total(self) -> int:
        """What streams and the cache may hold: the budget above the idle service."""
        return self.total - self.baseline

    @property
    def peak(self) -> int:
        return self._peak

    @property
    def waiting(self) -> int:
        """Charges waiting for room now."""
        return len(self._waiting)

    def _fits(self, nbytes: int) -> bool:
        return self._in_use() + nbytes <= self._ceiling

    def try_reserve(self, nbytes: int) -> bool:
        """Reserves ``nbytes`` if they fit now and no charge is waiting for room; never waits."""
        with self._cond:
            if self._waiting or not self._fits(nbytes):
                return False
            self._take(nbytes)
            return True

    def reserve(self, nbytes: int, *, what: str, stop: threading.Event | None = None) -> None:
        """Reserves ``nbytes``, waiting in arrival order up to wait_s for room (less if ``stop`` is
        set); ResourceExhausted naming ``what`` otherwise. A request larger than the budget's whole
        room for data fails at once."""
        room = self.data_total - int(HEADROOM * self.data_total) if self.baseline else self.data_total
        if nbytes > room:
            raise ResourceExhausted(f"{what} needs {nbytes} bytes, more than the server's whole memory budget "
                                    f"leaves for data ({room} of {self.total} bytes above the idle service's "
                                    f"{self.baseline}, memory_budget_bytes)")
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            if not self._waiting and self._fits(nbytes):
                self._take(nbytes)
                return
            waiter = _Waiter(nbytes, deadline)
            if not self._waiting:
                self._progress = time.monotonic()  # the first to wait: its stall clock starts now
            self._waiting.append(waiter)
        try:
            while True:
                with self._cond:
                    self._serve()
                    if waiter.granted:
                        return
                    left = deadline - time.monotonic()
                    if left <= 0 or (stop is not None and stop.is_set()):
                        raise ResourceExhausted(
                            f"the server's memory budget is in use ({self._used} bytes charged, {self._uncharged} "
                            f"more resident: the idle service's {self.baseline} and memory nobody charged; of "
                            f"{self.total}; {len(self._waiting) - 1} more charges waiting); {what} needs "
                            f"{nbytes} more", retry_after_s=5.0)
                    pressed = self._uncharged > self.baseline and time.monotonic() - self._last_pressure >= 1.0
                    if pressed:
                        self._last_pressure = time.monotonic()
                    else:
                        self._cond.wait(min(left, 0.2))
                if pressed:
                    self.on_pressure()
        finally:
            with self._cond:
                if not waiter.granted:
                    if waiter in self._waiting:  # else dropped by _serve, its wait over
                        self._waiting.remove(waiter)
                    self._serve()  # those behind it may fit now

    def _serve(self) -> None:
        """Gives room to the waiting charges in order (the caller holds the lock); after STALL_S with
        nothing returned, to the first one behind the first that fits. A charge whose wait is over
        leaves the queue here, whichever thread runs first: the one behind it need not wait for its
        thread to be scheduled."""
        now = time.monotonic()
        if any(w.deadline <= now for w in self._waiting):
            self._waiting = deque(w for w in self._waiting if w.deadline > now)
        served = False
        while self._waiting and self._fits(self._waiting[0].nbytes):
            self._grant(self._waiting.popleft())
            served = True
        if not served and len(self._waiting) > 1 and time.monotonic() - self._progress >= STALL_S:
            ahead = next((w for w in list(self._waiting)[1:] if self._fits(w.nbytes)), None)
            if ahead is not None:
                self._waiting.remove(ahead)
                self._grant(ahead)
                self.bypassed += 1
                served = True
        if served:
            self._cond.notify_all()

    def _grant(self, waiter: _Waiter) -> None:
        self._take(waiter.nbytes)
        waiter.granted = True
        self._progress = time.monotonic()

    def _take(self, nbytes: int) -> None:
        self._used += nbytes
        self._peak = max(self._peak, self._used)

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._used -= nbytes
            assert self._used >= 0, "released more than was reserved"
            if nbytes:
                self._progress = time.monotonic()
            self._serve()
            self._cond.notify_all()

    @property
    def committed(self) -> int:
        return self._committed

    def commit(self, nbytes: int, what: str) -> Callable[[], None]:
        """Admits a stream expected to hold up to ``nbytes``; returns the function that ends its
        commitment. ResourceExhausted while the open streams' commitments leave no room."""
        capacity = int(self.data_total * STREAM_SHARE)
        if nbytes > capacity:
            raise ResourceExhausted(f"{what} may hold about {nbytes} bytes, more than this server admits for any "
                                    f"stream ({capacity}: {STREAM_SHARE:.0%} of what memory_budget_bytes {self.total} "
                                    f"leaves above the idle service, {self.baseline}); "
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
        capacity = int(self.data_total * STREAM_SHARE)
        with self._cond:
            room = capacity - self._committed
        if nbytes > room:
            raise ResourceExhausted(f"the server's memory budget has {max(room, 0)} of {capacity} bytes left for "
                                    f"streams; {what} needs about {nbytes} to start (memory_budget_bytes)",
                                    retry_after_s=5.0)

    def try_cache(self, nbytes: int) -> bool:
        """Charges cache bytes (kept media) if they fit in the cache share and the budget and no
        charge is waiting for room; never waits."""
        with self._cond:
            if self._waiting or self._cache + nbytes > self.data_total * CACHE_SHARE or not self._fits(nbytes):
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
