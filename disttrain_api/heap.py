"""glibc malloc tuning shared by the service, its decode workers and the client: how freed heap
is reused and given back. Every function is a no-op off glibc. Free of numpy and protobuf, so a
decode worker imports nothing else for it."""

from __future__ import annotations

import functools


@functools.cache
def _libc():
    """The C library, loaded once (ctypes.util.find_library runs ``ldconfig -p``, a subprocess,
    which the server's memory sampler and housekeeping would pay every few seconds)."""
    import ctypes
    import ctypes.util

    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def tune_malloc() -> bool:
    """Lets glibc reuse freed heap memory for microbatch-sized buffers instead of mapping fresh
    pages for every message (mmap threshold 32 MiB, the most glibc allows; trim only above 256 MiB).
    Each fresh buffer of a microbatch's size costs a page fault per 4 KiB page, which dominated
    serialization and the client's copy. A no-op (False) where the C library is not glibc."""
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 256 << 20))


def trim_malloc() -> int:
    """Gives freed heap memory back to the system (glibc's malloc_trim); tune_malloc's high trim
    threshold otherwise keeps what a burst of messages freed. Returns 1 if memory was released."""
    try:
        return int(_libc().malloc_trim(0))
    except (OSError, AttributeError):
        return 0


def free_heap_bytes() -> int | None:
    """Bytes glibc's malloc holds free in its heaps (mallinfo2's fordblks, every arena), which
    trim_malloc can give back to the system. None off glibc (or before 2.33)."""
    import ctypes

    class _Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                         "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        mallinfo2 = _libc().mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _Mallinfo2
    return int(mallinfo2().fordblks)


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """Caps glibc's malloc arenas (M_ARENA_MAX). A server runs dozens of threads (streams, shard
    readers), and glibc gives each busy thread an arena of its own that keeps what it freed: with
    the default (8 per core) bench/soak.py saw the server's heap swing several times as far as with
    2, at the same throughput. A no-op (False) off glibc."""
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):
        return False
    m_arena_max = -8
    return bool(mallopt(m_arena_max, arenas))
