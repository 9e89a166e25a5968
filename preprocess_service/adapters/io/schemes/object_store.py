"""``s3``, ``gs``: object stores read through fsspec with the server's own credentials (the
[remote] extra), into the shard cache like http; off unless the operator lists them."""

from __future__ import annotations

from contextlib import AbstractContextManager

from preprocess_service.adapters.io import remote
from preprocess_service.adapters.io.schemes._base import Progress, Scheme, register
from preprocess_service.adapters.io.sources import Source


@register
class ObjectStore(Scheme):
    names = ("s3", "gs")
    naming = "url"

    def open(self, reader, source: Source, progress: Progress,
             start: int = 0) -> AbstractContextManager[remote.Opened]:
        connect = remote.fsspec_connector(source, reader.read_timeout_s)
        return remote.open_remote(source, connect, cache=reader.cache, fetch=reader.fetch,
                                  timeout_s=reader.read_timeout_s, progress=progress, start=start,
                                  owner=reader.owner)
