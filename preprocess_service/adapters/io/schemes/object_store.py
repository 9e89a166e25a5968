"""``s3``, ``gs``: object stores read through fsspec with the server's own credentials (the
[remote] extra), into the shard cache like http; off unless the operator lists them."""

from __future__ import annotations

from preprocess_service.adapters.io import remote
from preprocess_service.adapters.io.schemes._base import register
from preprocess_service.adapters.io.schemes._fetched import Fetched
from preprocess_service.adapters.io.sources import Source


@register
class ObjectStore(Fetched):
    names = ("s3", "gs")

    def connector(self, reader, source: Source) -> remote.Connector:
        return remote.fsspec_connector(source, reader.read_timeout_s)
