"""``http``, ``https``: downloaded once into the bounded shard cache (io/cache.py) and then read like
a local file, retried and resumed with Range requests after a dropped connection; a shard the
cache has no room for is streamed. Redirects are followed only to URLs the same policy allows."""

from __future__ import annotations

from preprocess_service.adapters.io import remote
from preprocess_service.adapters.io.schemes._base import register
from preprocess_service.adapters.io.schemes._fetched import Fetched
from preprocess_service.adapters.io.sources import Source


@register
class Http(Fetched):
    names = ("http", "https")

    def connector(self, reader, source: Source) -> remote.Connector:
        return remote.http_connector(source.location, reader.policy, reader.read_timeout_s)
