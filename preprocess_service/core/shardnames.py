"""A job's shard names as a sequence that need not hold them: a million shard names as Python
strings cost about 100 MB per copy, while a brace pattern (adapters/io/sources.py) can name shard
``i`` when it is asked for. Pure: no I/O (what a name is made of is the subclass's business).

- ``ShardNames``: ``len()``, ``names[i]`` (``name(i)``), iteration, equality with any sequence of
  str, and ``position(url)``: where a name stands, from an index of 12 bytes per name built on
  the first lookup (a plan record or a replica names shards by URL);
- ``ListNames``: names held as given (small jobs, tests);
- ``Concat``: several sequences one after the other (a job's specs, a mixture's datasets);
- ``Permuted``: a seeded shard order as a permutation of positions (4 bytes per shard), not a
  copy of the names.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

import numpy as np

from disttrain_api.errors import ConfigError, PermissionDenied


class ShardNames(Sequence[str]):
    """Shard names, each computed when asked for (subclasses give ``__len__`` and ``name``)."""

    _index: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        raise NotImplementedError

    def name(self, i: int) -> str:
        """The name at position ``0 <= i < len(self)``."""
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> ListNames: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return ListNames(self.name(j) for j in range(*i.indices(len(self))))
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"shard {i} of {n}")
        return self.name(i + n if i < 0 else i)

    def __iter__(self) -> Iterator[str]:
        for i in range(len(self)):
            yield self.name(i)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (str, bytes)) or not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        head = ", ".join(repr(self.name(i)) for i in range(min(3, len(self))))
        return f"{type(self).__name__}([{head}{', ...' if len(self) > 3 else ''}] of {len(self)})"

    def quick_names(self) -> Iterator[str]:
        """Every name, as cheaply as the sequence can make them (a pattern's spelling where it is
        its normalised name): for whole-list checks such as a mixture's overlap. A name that
        cannot be made (safe_name) is ""."""
        return (self.safe_name(i) for i in range(len(self)))

    def safe_name(self, i: int) -> str:
        """``name(i)``, or "" when it cannot be made (a pattern's name the policy refuses: it is
        reported when its shard would open, never opened)."""
        try:
            return self.name(i)
        except (ConfigError, PermissionDenied):
            return ""

    def __contains__(self, url: object) -> bool:
        return isinstance(url, str) and self.position(url) is not None

    def position(self, url: str) -> int | None:
        """Where ``url`` stands (its first place), or None. The first call names every shard once
        and keeps their hashes and positions (12 bytes per name)."""
        if self._index is None:
            self._index = hash_index((self.safe_name(i) for i in range(len(self))), len(self))
        return self._find(self._index, url)

    def _find(self, index: tuple[np.ndarray, np.ndarray], url: str) -> int | None:
        """The first position whose hash in ``index`` (hash_index) is ``url``'s and whose name is
        ``url``, or None."""
        hashes, order = index
        h = hash(url)
        i = int(np.searchsorted(hashes, h))
        while i < len(hashes) and hashes[i] == h:
            if self.name(int(order[i])) == url:
                return int(order[i])
            i += 1
        return None


class ListNames(ShardNames):
    """Names held as given."""

    def __init__(self, names: Iterable[str] = ()):
        self._names = tuple(names)
        self._where: dict[str, int] | None = None

    def __len__(self) -> int:
        return len(self._names)

    def name(self, i: int) -> str:
        return self._names[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def position(self, url: str) -> int | None:
        if self._where is None:
            where: dict[str, int] = {}
            for i, name in enumerate(self._names):
                where.setdefault(name, i)
            self._where = where
        return self._where.get(url)


class Concat(ShardNames):
    """``parts`` one after the other."""

    def __init__(self, parts: Iterable[Sequence[str]]):
        self.parts = [as_names(part) for part in parts if len(part)]
        self._starts = [0]
        for part in self.parts:
            self._starts.append(self._starts[-1] + len(part))

    def __len__(self) -> int:
        return self._starts[-1]

    def name(self, i: int) -> str:
        k = bisect.bisect_right(self._starts, i) - 1
        return self.parts[k].name(i - self._starts[k])

    def __iter__(self) -> Iterator[str]:
        for part in self.parts:
            yield from part

    def quick_names(self) -> Iterator[str]:
        for part in self.parts:
            yield from part.quick_names()

    def position(self, url: str) -> int | None:
        for start, part in zip(self._starts, self.parts):
            where = part.position(url)
            if where is not None:
                return start + where
        return None


class Permuted(ShardNames):
    """``base`` in the order ``perm`` (``self[i] == base[perm[i]]``)."""

    def __init__(self, base: Sequence[str], perm: np.ndarray):
        self.base = as_names(base)
        if len(perm) != len(self.base):
            raise ValueError(f"a permutation of {len(perm)} for {len(self.base)} names")
        self.perm = np.asarray(perm, dtype=np.int64 if len(perm) >= 2**31 else np.int32)

    def __len__(self) -> int:
        return len(self.base)

    def name(self, i: int) -> str:
        return self.base.name(int(self.perm[i]))


def hash_index(names: Iterable[str], n: int) -> tuple[np.ndarray, np.ndarray]:
    """(sorted hashes, positions in that order) of ``n`` names: 12 bytes a name."""
    hashes = np.fromiter((hash(name) for name in names), dtype=np.int64, count=n)
    order = np.argsort(hashes, kind="stable").astype(np.int64 if n >= 2**31 else np.int32)
    return hashes[order], order


def as_names(names: Sequence[str]) -> ShardNames:
    """``names`` as a ShardNames (held as given unless it is one already)."""
    return names if isinstance(names, ShardNames) else ListNames(names)


def positions(order: Sequence[str], base: Sequence[str]) -> np.ndarray:
    """int64[len(order)]: the position in ``base`` of each name of ``order`` (a Permuted of
    ``base`` answers from its permutation, without naming a shard)."""
    if isinstance(order, Permuted) and order.base is base:
        return order.perm.astype(np.int64)
    if order is base:
        return np.arange(len(base), dtype=np.int64)
    names = as_names(base)
    out = np.empty(len(order), dtype=np.int64)
    for i, url in enumerate(order):
        where = names.position(url)
        if where is None:
            raise ValueError(f"shard {url!r} is not one of the dataset's")
        out[i] = where
    return out
