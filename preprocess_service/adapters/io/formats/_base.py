"""The Format contract and its registry (formats/__init__.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import BinaryIO, ClassVar

from disttrain_api.errors import SampleError
from preprocess_service.adapters.io.tarstream import TarLimits

ProblemSink = Callable[[SampleError], None]
FORMATS: dict[str, Format] = {}
"""Suffix (".parquet") -> the format that reads files named so."""


class Format:
    """One shard format. Its file is opened by its scheme (local, or a remote shard's cached
    copy: a format that needs to seek is read from a local file only)."""

    name: ClassVar[str] = ""
    suffixes: ClassVar[tuple[str, ...]] = ()
    magic: ClassVar[tuple[bytes, ...]] = ()
    """How such a file starts, after any white space (empty: anything); sources checks it."""
    in_folders: ClassVar[bool] = False
    """A folder with no *.tar file stands for its files of this format (sorted)."""

    def iter_samples(self, f: BinaryIO, path: str, url: str, limits: TarLimits, report: ProblemSink,
                     first: int = 0) -> Iterator[dict]:
        """The shard's raw samples in order from record ``first`` (a row, a JSON record), each
        with NEXT_OFFSET set to the record after it: a resume starts there, whatever was skipped
        before. A bad sample goes to ``report`` with its key and the rest go on."""
        raise NotImplementedError

    def keys(self, f: BinaryIO, path: str, url: str, limits: TarLimits) -> Iterator[str]:
        """The keys ``iter_samples`` gives, in order, as cheaply as the format allows."""
        return (sample["__key__"] for sample in self.iter_samples(f, path, url, limits, lambda problem: None))

    def read_samples(self, f: BinaryIO, path: str, url: str, keys: set[str], limits: TarLimits) -> dict[str, dict]:
        """The raw samples of ``keys``; keys that cannot be read are missing."""
        out: dict[str, dict] = {}
        for sample in self.iter_samples(f, path, url, limits, lambda problem: None):
            if sample["__key__"] in keys:
                out[sample["__key__"]] = sample
                if len(out) == len(keys):
                    break
        return out


def register(cls: type[Format]) -> type[Format]:
    instance = cls()
    for suffix in cls.suffixes:
        if suffix in FORMATS:
            raise ValueError(f"two formats read {suffix!r} files: {FORMATS[suffix].name} and {cls.name}")
        FORMATS[suffix] = instance
    return cls


def format_of(url: str) -> Format | None:
    """The format a shard named ``url`` is read as (its suffix), or None for a WebDataset tar."""
    base = url.rsplit("/", 1)[-1].lower()
    return next((fmt for suffix, fmt in FORMATS.items() if base.endswith(suffix)), None)


def suffixes() -> tuple[str, ...]:
    return tuple(FORMATS)
