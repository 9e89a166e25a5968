"""Every other scheme (``pipe:`` and the schemes webdataset's gopen serves by running a program),
read through gopen as a stream that cannot start mid-shard; only when the operator lists the
scheme in allowed_shard_schemes (sources.check refuses it otherwise)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from preprocess_service.adapters.io.remote import Opened
from preprocess_service.adapters.io.schemes._base import Progress, Scheme, register
from preprocess_service.adapters.io.sources import Source


@register
class Program(Scheme):
    names = ()  # the fallback: any scheme no other file names

    @contextmanager
    def open(self, reader, source: Source, progress: Progress, start: int = 0) -> Iterator[Opened]:
        from webdataset.gopen import gopen  # heavy, and only schemes the operator enabled get here

        with gopen(source.location, "rb") as f:
            yield Opened(f, None, positioned=False)
