"""The resident memory of the service's processes, read cheaply enough to sample twice a second.

``/proc/PID/smaps_rollup`` (PSS) walks every page table, a cost that grows with the process's
size. The ``RssAnon``/``RssFile``/``RssShmem`` lines of ``/proc/PID/status`` are kept by the
kernel as counters, read at a small fixed cost. Summed naively, RSS counts a shared page once
per process that maps it, so this estimate counts:

- anonymous memory (heap, stacks, Python objects): private to each process, summed;
- file pages (the interpreter and libraries, mapped by the server and every decode worker alike):
  the largest process's, once;
- shared memory (the decode arenas in /dev/shm, which the server maps to read results): the
  largest process's, once.

The estimate differs from PSS by a near-constant amount (file pages shared between the processes,
shared memory mapped in part), so the server calibrates it against ``pss_bytes`` now and then
(``Calibrated``). bench/soak.py checks the result against PSS. Linux only: elsewhere both return
None and the budget counts its charges alone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

_FIELDS = {b"RssAnon:": 0, b"RssFile:": 1, b"RssShmem:": 2}


def _rss_kib(pid: int) -> tuple[int, int, int] | None:
    """(anonymous, file, shared memory) resident KiB of ``pid``; None if it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read(8192)
    except OSError:
        return None
    values = [0, 0, 0]
    found = 0
    for line in text.splitlines():
        parts = line.split()
        slot = _FIELDS.get(parts[0]) if len(parts) >= 2 else None
        if slot is not None and parts[1].isdigit():
            values[slot] = int(parts[1])
            found += 1
    return (values[0], values[1], values[2]) if found == 3 else None


def resident_bytes(pids: Iterable[int]) -> int | None:
    """The estimated resident memory of ``pids`` together (see the module's doc), bytes; None when
    none of them can be read (not Linux, or all gone)."""
    anon = file = shmem = 0
    seen = False
    for pid in pids:
        kib = _rss_kib(pid)
        if kib is None:
            continue
        seen = True
        anon += kib[0]
        file = max(file, kib[1])
        shmem = max(shmem, kib[2])
    return (anon + file + shmem) * 1024 if seen else None


def descendants(pid: int) -> list[int]:
    """Every process started by ``pid`` or by one of its descendants, at any depth (the decode
    workers, forked by the fork server, which the server started); [] where /proc has no
    ``children`` lists. A process that ends meanwhile is left out."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:  # children are listed under the thread that started them
            try:
                with open(f"/proc/{parent}/task/{task}/children", "rb") as f:
                    children = [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                continue
            found += children
            todo += children
    return found


def pss_bytes(pids: Iterable[int]) -> int | None:
    """The exact proportional set size of ``pids`` together (a page shared by n processes counts
    1/n in each), bytes; it walks every page table (smaps_rollup). None when none can be read."""
    total = 0
    seen = False
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
                text = f.read(8192)
        except OSError:
            continue
        for line in text.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == b"Pss:" and parts[1].isdigit():
                total += int(parts[1]) * 1024
                seen = True
                break
    return total if seen else None


class Calibrated:
    """``resident_bytes`` of the processes ``pids()`` names, corrected by its difference from
    ``pss_bytes`` measured every ``every_s`` (at the first call too)."""

    def __init__(self, pids: Callable[[], list[int]], every_s: float = 10.0):
        self.pids = pids
        self.every_s = every_s
        self.offset = 0
        self._calibrated_at = float("-inf")

    def __call__(self) -> int | None:
        pids = self.pids()
        estimate = resident_bytes(pids)
        if estimate is None:
            return None
        if time.monotonic() - self._calibrated_at >= self.every_s:
            exact = pss_bytes(pids)
            self._calibrated_at = time.monotonic()
            if exact is not None:
                self.offset = estimate - exact
                return exact
        return max(0, estimate - self.offset)
