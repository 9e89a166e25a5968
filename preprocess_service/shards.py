"""Shard I/O: expand shard specs, read LAION-style webdataset tars, refetch samples by key.

Reading goes through webdataset's tar iterators, so every URL its gopen understands works
(local paths, file:, pipe:, http(s): ...). Only tar members are read: the NNNNN.parquet and
NNNNN_stats.json files img2dataset writes beside each tar are never opened.
"""

from __future__ import annotations

import functools
import os
import re
import tarfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
from webdataset import shardlists, tariterators

from preprocess_service.errors import ConfigError

ErrorSink = Callable[[str, str], None]
"""Called with (shard url, reason) for a problem that is not tied to one sample key."""


def expand_shards(specs: Iterable[str]) -> list[str]:
    """Brace-expands each spec (webdataset syntax, ``::`` separates lists) and turns a local
    directory into its sorted ``*.tar`` files. Local paths must exist (ConfigError otherwise)."""
    urls: list[str] = []
    for spec in specs:
        for url in shardlists.expand_urls(spec):
            urls.extend(_expand_local(url))
    if not urls:
        raise ConfigError(f"the shard specs {list(specs)!r} expand to no shard")
    return urls


def _expand_local(url: str) -> list[str]:
    parsed = urlparse(url)
    if parsed.scheme not in ("", "file"):
        return [url]  # remote or pipe: cannot be checked without opening it
    path = Path(parsed.path if parsed.scheme == "file" else url)
    if path.is_dir():
        tars = sorted(str(p) for p in path.glob("*.tar"))
        if not tars:
            raise ConfigError(f"shard directory {str(path)!r} holds no *.tar file")
        return tars
    if not path.exists():
        raise ConfigError(f"shard {url!r} does not exist")
    return [url]


def iter_shard(url: str, on_error: ErrorSink) -> Iterator[dict]:
    """Raw samples of one shard (``__key__``, ``__url__``, ext -> bytes). A broken tar is reported
    through ``on_error`` and ends that shard only."""

    def handler(exc: Exception) -> bool:
        if isinstance(exc, (MemoryError, ImportError)):
            return False  # never swallowed: webdataset re-raises when the handler says False
        on_error(url, f"shard read error: {type(exc).__name__}: {exc}")
        return True

    yield from tariterators.tarfile_samples([{"url": url}], handler=handler)


def fetch_samples(url: str, keys: set[str]) -> dict[str, dict]:
    """Re-reads one shard and returns the raw samples whose key is in ``keys``."""
    found: dict[str, dict] = {}
    # A read error here was already reported when the shard was planned; keys it hides come back
    # missing, and the caller reports those samples.
    for sample in iter_shard(url, lambda _url, _reason: None):
        if sample["__key__"] in keys:
            found[sample["__key__"]] = sample
            if len(found) == len(keys):
                break
    return found


def read_samples(url: str, keys: set[str]) -> dict[str, dict]:
    """The raw samples of ``keys`` in one shard. A local tar is read at the members' offsets (an
    index of its headers is built once per file version and cached); other URLs are scanned."""
    path = local_path(url)
    if path is None:
        return fetch_samples(url, keys)
    stat = os.stat(path)
    index = _tar_index(path, stat.st_mtime_ns, stat.st_size)
    found: dict[str, dict] = {}
    with open(path, "rb") as f:
        for key in keys:
            members = index.get(key)
            if members is not None:
                sample = {"__key__": key, "__url__": url}
                for suffix, (offset, size) in members.items():
                    sample[suffix] = os.pread(f.fileno(), size, offset)
                found[key] = sample
    return found


_META = re.compile(r"__[^/]*__($|/)")


@functools.lru_cache(maxsize=16)  # a step draws from a few shards at a time; ~5 MB per 10k-sample shard
def _tar_index(path: str, mtime_ns: int, size: int) -> dict[str, dict[str, tuple[int, int]]]:
    """key -> {member suffix: (data offset, size)} of a local tar, members grouped into samples as
    webdataset groups them (base_plus_ext, lower-case suffix, meta files skipped). ``mtime_ns`` and
    ``size`` only key the cache: a rewritten file gets a new index."""
    index: dict[str, dict[str, tuple[int, int]]] = {}
    try:
        with tarfile.open(path, "r:") as tar:
            for info in tar:
                if not info.isreg() or _META.match(info.name):
                    continue
                prefix, suffix = tariterators.base_plus_ext(info.name)
                if prefix is not None:
                    index.setdefault(prefix, {})[suffix.lower()] = (info.offset_data, info.size)
    except (tarfile.TarError, EOFError):
        pass  # a broken tail: the samples before it are indexed; planning reported the damage
    # (an OSError, e.g. a network file system away, propagates: nothing partial is cached)
    return index


def shard_order(urls: list[str], *, seed: int, epoch: int, shuffle: bool) -> list[str]:
    """The epoch's shard order: a seeded permutation (or the given order)."""
    if not shuffle:
        return list(urls)
    rng = np.random.default_rng([seed, epoch, 0x5A4D])
    return [urls[i] for i in rng.permutation(len(urls))]


def shuffle_buffer(items: Iterable, *, size: int, rng: np.random.Generator) -> Iterator:
    """Seeded streaming shuffle: fill a buffer of ``size`` items, emit a random one per new item."""
    if size <= 1:
        yield from items
        return
    buffer: list = []
    for item in items:
        buffer.append(item)
        if len(buffer) >= size:
            index = int(rng.integers(len(buffer)))
            buffer[index], buffer[-1] = buffer[-1], buffer[index]
            yield buffer.pop()
    while buffer:
        index = int(rng.integers(len(buffer)))
        buffer[index], buffer[-1] = buffer[-1], buffer[index]
        yield buffer.pop()


def local_path(url: str) -> str | None:
    """The filesystem path of a local shard URL, else None."""
    parsed = urlparse(url)
    if parsed.scheme == "":
        return url
    if parsed.scheme == "file":
        return os.path.abspath(parsed.path)
    return None
