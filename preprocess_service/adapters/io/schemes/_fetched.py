"""The base of schemes whose shards are fetched into the shard cache (remote.open_remote): a
subclass says only how to connect to one shard."""

from __future__ import annotations

from contextlib import AbstractContextManager

from preprocess_service.adapters.io import remote
from preprocess_service.adapters.io.schemes._base import Progress, Scheme
from preprocess_service.adapters.io.sources import Source


class Fetched(Scheme):
    naming = "url"

    def connector(self, reader, source: Source) -> remote.Connector:
        raise NotImplementedError

    def open(self, reader, source: Source, progress: Progress,
             start: int = 0) -> AbstractContextManager[remote.Opened]:
        return remote.open_remote(source, self.connector(reader, source), cache=reader.cache, fetch=reader.fetch,
                                  timeout_s=reader.read_timeout_s, progress=progress, start=start,
                                  owner=reader.owner)
