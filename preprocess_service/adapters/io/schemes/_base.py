"""The Scheme base class and the registry (schemes/__init__.py imports every scheme file)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, ClassVar, TypeVar

from preprocess_service.adapters.io import sources
from preprocess_service.adapters.io.sources import Source

if TYPE_CHECKING:
    from preprocess_service.adapters.io.remote import Opened
    from preprocess_service.adapters.io.shards import ShardReader

Progress = Callable[[], None]


class Scheme:
    """How shards of the schemes in ``names`` are opened. ``naming`` is their names' rule
    (sources.NAMING: "path", "url" with a host, or "opaque"); ``indexed``: once open, a shard has a
    local file (``Opened.path``) that read_samples reads by offset, else it is scanned."""

    names: ClassVar[tuple[str, ...]] = ()
    naming: ClassVar[str] = "opaque"

    def open(self, reader: ShardReader, source: Source, progress: Progress,
             start: int = 0) -> AbstractContextManager[Opened]:
        """``source`` from byte ``start`` where it can start there (``Opened.positioned``)."""
        raise NotImplementedError

    def rereads_cheaply(self, source: Source) -> bool:
        """Whether a sample read again later costs only a ``pread`` (local uncompressed tars)."""
        return False


SCHEMES: dict[str, Scheme] = {}
S = TypeVar("S", bound=type[Scheme])
_FALLBACK: list[Scheme] = []


def register(cls: S) -> S:
    """Registers an instance of ``cls`` under each of its names; ``names = ()`` registers the
    fallback for schemes no file names (there is one: program.py)."""
    scheme = cls()
    if not cls.names:
        _FALLBACK[:] = [scheme]
    for name in cls.names:
        if name in SCHEMES:
            raise ValueError(f"two shard schemes named {name!r}")
        SCHEMES[name] = scheme
        sources.NAMING[name] = cls.naming
    return cls


def scheme_of(source: Source) -> Scheme:
    return SCHEMES.get(source.scheme) or _FALLBACK[0]

