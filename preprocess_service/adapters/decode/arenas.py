"""The decode pool's shared-memory arenas: one per microbatch being decoded (control bytes, the
output buffer, room for its token arrays, its encoded inputs), charged to the memory budget from
creation to destruction. Acquired by size (powers of two from 4 MiB, a few kept free), released
after delivery, or lent to a client on this host (same-host delivery, shm.py): the client maps
the arena itself, and the arena comes back (reclaimed) once the client has taken it and let go of
its lock, with a fresh token so that no old message can name it again."""

from __future__ import annotations

import collections
import fcntl
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from preprocess_service.adapters.decode.items import Lent
from preprocess_service.adapters.decode.shm import CONTROL_BYTES, SHM_DIR, TAKEN_AT, TOKEN_BYTES, object_name
from preprocess_service.adapters.infra.budget import MemoryBudget
from preprocess_service.core.assemble import aligned

MAX_LENT = 256
"""Arenas lent to clients and taken at once, at most; beyond, the oldest are given away (unlinked
and forgotten here: the client's mapping keeps them), so a client that keeps every microbatch
costs the server no file descriptors or mappings."""


@dataclass(slots=True)
class _LentArena:
    arena: shared_memory.SharedMemory
    lock_fd: int
    abandoned: bool = False
    charged: bool = True
    """Still charged to the budget: a taken arena is the client's memory until it comes back."""



class Arenas:
    """Every arena of one pool. ``lock`` is the pool's (one lock for the pool's state and its
    arenas'); ``wake`` tells the pool's dispatcher that arenas were destroyed (the workers unmap
    them); ``keep`` free arenas are kept for reuse."""

    def __init__(self, lock: threading.Lock, budget: MemoryBudget, keep: int, wake: Callable[[], None]):
        self._lock, self.budget, self.keep, self.wake = lock, budget, keep, wake
        self._free: list[shared_memory.SharedMemory] = []
        self.all: dict[str, shared_memory.SharedMemory] = {}
        self._lock_fds: dict[str, int] = {}
        """Arena name -> this process's descriptor for flock (the client's lock shows on it)."""
        self.lent_arenas: collections.OrderedDict[str, _LentArena] = collections.OrderedDict()
        self._to_drop: list[str] = []
        """Arenas destroyed or given away that the workers still map (the dispatcher tells them)."""
        self._reclaiming = threading.Lock()
        """One reclaim at a time (two could both lock an arena through the one descriptor)."""
        self.counters: collections.Counter = collections.Counter()
        self.closed = False

    def lendable(self, arena: shared_memory.SharedMemory) -> bool:
        """It has a /dev/shm path a client can open (Linux)."""
        return self._lock_fds.get(arena.name, -1) >= 0

    def take_dropped(self) -> list[str]:
        """Names destroyed since the last call (caller holds the lock)."""
        dropped, self._to_drop = self._to_drop, []
        return dropped

    def close(self) -> None:
        """Destroys every arena, lent ones included (their clients' mappings keep theirs)."""
        with self._reclaiming, self._lock:  # no reclaim runs now, and none will (closed)
            self.closed = True
            uncharged = {name for name, entry in self.lent_arenas.items() if not entry.charged}
            self.lent_arenas.clear()
            arenas = list(self.all.values())
        for arena in arenas:
            self._destroy_charged(arena, charged=arena.name not in uncharged)
        self.all.clear()

    def acquire(self, nbytes: int, stop: threading.Event | None = None) -> shared_memory.SharedMemory:
        self.reclaim()
        while True:
            with self._lock:
                fits = [a for a in self._free if a.size >= nbytes]
                if not fits:
                    break
                arena = min(fits, key=lambda a: a.size)
                self._free.remove(arena)
            if self.still_named(arena):
                return arena
            with self._lock:  # someone removed its name (cleaned /dev/shm): workers could not map it
                self.all.pop(arena.name, None)
            self._destroy_charged(arena)
        size = max(1 << 22, 1 << (max(nbytes, 1) - 1).bit_length())  # powers of two from 4 MiB: few sizes
        if not self.budget.try_reserve(size):
            self.drop_free()  # idle arenas give their share back first
            self.budget.reserve(size, what="a microbatch's shared-memory decode arena", stop=stop)
        try:  # named as a delivered object: a client maps it when it is lent, the sweep finds it
            arena = shared_memory.SharedMemory(name=object_name(), create=True, size=size)
        except BaseException:
            self.budget.release(size)
            raise
        try:
            lock_fd = os.open(os.path.join(SHM_DIR, arena.name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            lock_fd = -1  # no /dev/shm path (not Linux): never lent
        with self._lock:
            self.all[arena.name] = arena
            self._lock_fds[arena.name] = lock_fd
        return arena

    def still_named(self, arena: shared_memory.SharedMemory) -> bool:
        """Its name in /dev/shm still leads to it (one a cleaner removed cannot be mapped again)."""
        lock_fd = self._lock_fds.get(arena.name, -1)
        if lock_fd < 0:
            return True  # not Linux: nothing to check
        try:
            return os.stat(os.path.join(SHM_DIR, arena.name)).st_ino == os.fstat(lock_fd).st_ino
        except OSError:
            return False

    def idle_bytes(self) -> int:
        with self._lock:
            return sum(a.size for a in self._free)

    def drop_free(self) -> None:
        with self._lock:
            free, self._free = self._free, []
            for arena in free:
                del self.all[arena.name]
        for arena in free:
            self._destroy_charged(arena)

    def _destroy_charged(self, arena: shared_memory.SharedMemory, charged: bool = True) -> None:
        size = arena.size
        with self._lock:
            lock_fd = self._lock_fds.pop(arena.name, -1)
            self._to_drop.append(arena.name)
        if lock_fd >= 0:
            os.close(lock_fd)
        _destroy(arena)
        if charged:
            self.budget.release(size)
        self.wake()  # the dispatcher tells the workers

    def release(self, arena: shared_memory.SharedMemory) -> None:
        with self._lock:
            if self.closed:  # close() frees it
                return
            self._free.append(arena)
            if len(self._free) <= self.keep:  # keep a few, give the rest back
                return
            smallest = min(self._free, key=lambda a: a.size)
            self._free.remove(smallest)
            del self.all[smallest.name]
        self._destroy_charged(smallest)

    def lend(self, batch: Any, arrays: dict[str, np.ndarray]) -> Lent | None:
        """Lends ``batch``'s arena (a pool's microbatch: its ``arena``, output ``nbytes``, ``spare``
        room and ``lent`` flag) with ``arrays`` (views of its output buffer, or copied into its
        spare room); None (nothing lent) when an array neither is in it nor fits the spare room."""
        arena = batch.arena
        if not self.still_named(arena):  # the client could not open it; the copy goes elsewhere
            return None
        view = np.ndarray((arena.size,), dtype=np.uint8, buffer=arena.buf)
        start = view.__array_interface__["data"][0]
        cursor, end = CONTROL_BYTES + batch.nbytes, CONTROL_BYTES + batch.nbytes + batch.spare
        tensors = []
        for name, array in arrays.items():
            address = array.__array_interface__["data"][0]
            if array.flags.c_contiguous and start + CONTROL_BYTES <= address and \
                    address + array.nbytes <= start + CONTROL_BYTES + batch.nbytes:
                offset = address - start
            else:
                if cursor + array.nbytes > end:
                    return None
                offset = cursor
                view[offset:offset + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
                cursor += aligned(array.nbytes)
            tensors.append((name, array.dtype, tuple(array.shape), offset))
        token = os.urandom(TOKEN_BYTES)
        view[:TOKEN_BYTES] = np.frombuffer(token, dtype=np.uint8)
        view[TAKEN_AT] = 0
        del view
        entry = _LentArena(arena, self._lock_fds[arena.name])
        with self._lock:
            if self.closed or batch.lent:
                return None
            batch.lent = True  # from here on reclaim() alone gives it back, whoever releases the batch
            self.lent_arenas[arena.name] = entry
            self.counters["arenas_lent"] += 1
        nbytes = max((offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                      for _, dtype, shape, offset in tensors), default=CONTROL_BYTES)
        return Lent(arena.name, token, nbytes, tensors, taken=lambda: self._taken(arena.name, entry),
                    abandon=lambda: self._abandon(arena.name, entry))

    def _taken(self, name: str, entry: _LentArena) -> bool:
        """This lending is over for the stream: the client marked it taken, or the pool already
        took the arena back (the mark is cleared then; the arena may be lent again meanwhile)."""
        with self._lock:
            if self.lent_arenas.get(name) is not entry:
                return True
            return entry.arena.buf[TAKEN_AT] != 0

    def _abandon(self, name: str, entry: _LentArena) -> None:
        with self._lock:
            if self.lent_arenas.get(name) is not entry:  # already back (and maybe lent again: not that one)
                return
            entry.abandoned = True
        self.reclaim()

    def reclaim(self) -> None:
        """Takes back the lent arenas whose client is done (taken, or abandoned, and not locked):
        a fresh token invalidates any message still naming them. A taken arena stops counting
        toward the budget until it is back; past MAX_LENT taken ones, the oldest are given away."""
        with self._reclaiming:
            self._reclaim_locked()

    def _reclaim_locked(self) -> None:
        with self._lock:
            if not self.lent_arenas or self.closed:
                return
            entries = list(self.lent_arenas.items())
        back, uncharge, give = [], 0, []
        for name, entry in entries:
            taken = entry.arena.buf[TAKEN_AT] != 0
            if not (taken or entry.abandoned):
                continue  # sent, not yet taken: the stream's window bounds these
            try:
                fcntl.flock(entry.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # the client still has it
                if taken and entry.charged:
                    entry.charged = False
                    uncharge += entry.arena.size
                continue
            try:
                entry.arena.buf[:TOKEN_BYTES] = os.urandom(TOKEN_BYTES)
                entry.arena.buf[TAKEN_AT] = 0
            finally:
                fcntl.flock(entry.lock_fd, fcntl.LOCK_UN)
            back.append((name, entry))
        with self._lock:
            for name, _ in back:
                self.lent_arenas.pop(name, None)
            held = [(n, e) for n, e in self.lent_arenas.items() if not e.charged]
            for name, entry in held[:max(0, len(held) - MAX_LENT)]:
                del self.lent_arenas[name]
                del self.all[name]
                give.append(entry)
            self.counters["arenas_given_away"] += len(give)
        if uncharge:
            self.budget.release(uncharge)
        for name, entry in back:
            if entry.charged or self.budget.try_reserve(entry.arena.size):
                self.release(entry.arena)
            else:  # no room for it in the budget now: let it go
                with self._lock:
                    self.all.pop(name, None)
                self._destroy_charged(entry.arena, charged=False)
        for entry in give:
            self._destroy_charged(entry.arena, charged=False)


def _destroy(arena: shared_memory.SharedMemory) -> None:
    try:
        arena.close()
    except BufferError:
        pass  # a view is still alive somewhere; the mapping goes with it
    try:
        arena.unlink()
    except FileNotFoundError:
        pass
