"""``file``: local paths (sources.parse made them real paths). Opened non-blocking and checked to
be a regular file before any read, so a FIFO, a device or a socket fails that shard at once."""

from __future__ import annotations

import functools
import os
import stat
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager

from preprocess_service.adapters.io.remote import Opened, ShardReadError
from preprocess_service.adapters.io.schemes._base import Progress, Scheme, register
from preprocess_service.adapters.io.sources import Source


@register
class LocalFiles(Scheme):
    names = ("file",)
    naming = "path"

    @contextmanager
    def open(self, reader, source: Source, progress: Progress, start: int = 0) -> Iterator[Opened]:
        with open_regular(source.location) as f:
            f.seek(start)
            yield Opened(f, source.location)

    def rereads_cheaply(self, source: Source) -> bool:
        """A local uncompressed tar: read_samples reads a sample again by ``pread`` at its members'
        offsets. A compressed one is re-read by decompressing it from the start."""
        try:
            st = os.stat(source.location)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and is_plain_tar(source.location, st.st_mtime_ns, st.st_size)


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


@functools.lru_cache(maxsize=1024)
def is_plain_tar(path: str, mtime_ns: int, size: int) -> bool:
    """Whether a local file starts with an uncompressed tar header (POSIX or GNU "ustar" magic).
    ``mtime_ns`` and ``size`` only key the cache."""
    try:
        with open_regular(path) as f:
            head = f.read(tarfile.BLOCKSIZE)
    except OSError:
        return False
    return len(head) == tarfile.BLOCKSIZE and head[257:262] == b"ustar"
