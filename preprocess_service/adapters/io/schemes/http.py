"""``http``, ``https``: downloaded once into the bounded shard cache (io/cache.py) and then read like
a local file, retried and resumed with Range requests after a dropped connection; a shard the
cache has no room for is streamed. Redirects are followed only to URLs the same policy allows."""

from __future__ import annotations

from contextlib import AbstractContextManager

from preprocess_service.adapters.io import remote
from preprocess_service.adapters.io.schemes._base import Progress, Scheme, register
from preprocess_service.adapters.io.sources import Source


@register
class Http(Scheme):
    names = ("http", "https")
    naming = "url"

    def open(self, reader, source: Source, progress: Progress,
             start: int = 0) -> AbstractContextManager[remote.Opened]:
        connect = remote.http_connector(source.location, reader.policy, reader.read_timeout_s)
        return remote.open_remote(source, connect, cache=reader.cache, fetch=reader.fetch,
                                  timeout_s=reader.read_timeout_s, progress=progress, start=start,
                                  owner=reader.owner)
