"""Media retention: which documents hold their encoded bytes between planning and decoding, and
their charge to the memory budget (adapters/infra/budget.py).

A document planned now keeps its bytes only when re-reading them later is dear and the budget
has room; the rest are re-read from their shards when their microbatch is decoded. Bytes are
dropped (and their charge released) once the decoder has taken them, once every rank was sent
their step, when a step leaves the retained window, or when the job closes."""

from __future__ import annotations

import dataclasses
import threading
from collections import defaultdict

from preprocess_service.adapters.infra.budget import UNLIMITED, MemoryBudget
from preprocess_service.adapters.io import shards
from preprocess_service.adapters.media.parse import IMAGE_EXTENSIONS
from preprocess_service.core.packing import PackedSequence
from preprocess_service.core.sample import Document


def media_nbytes(doc: Document) -> int:
    return sum(len(b) for b in (doc.media_bytes or {}).values())


class MediaRetention:
    """Keeps, drops and releases documents' encoded bytes, charged to ``budget``."""

    def __init__(self, reader: shards.ShardReader, budget: MemoryBudget = UNLIMITED):
        self.reader, self.budget = reader, budget
        self._lock = threading.Lock()
        self.held_bytes = 0
        self._closed = False

    def keep(self, doc: Document) -> bool:
        """May ``doc`` keep its encoded bytes until it is decoded? Not one of a local uncompressed
        tar: its bytes are read again by ``pread`` when its microbatch is decoded
        (ShardReader.rereads_cheaply), cheaper than holding them through the shuffle buffer, the
        packer and the planned steps. The others are held while the memory budget has room."""
        if self.reader.rereads_cheaply(doc.shard):
            return False
        nbytes = media_nbytes(doc)
        if self._closed or not self.budget.try_cache(nbytes):
            return False
        with self._lock:
            if self._closed:  # close() released what was held; this charge would leak
                self.budget.release_cache(nbytes)
                return False
            self.held_bytes += nbytes
        return True

    def drop(self, doc: Document) -> None:
        """Drops a document's encoded bytes and their charge."""
        with self._lock:
            nbytes = media_nbytes(doc)
            had, doc.media_bytes = doc.media_bytes is not None, None
            if had and not self._closed:  # after close() nothing is charged
                self.held_bytes -= nbytes
                self.budget.release_cache(nbytes)

    def close(self) -> None:
        """Releases every charge, including documents the planner still held (its shuffle buffer,
        open sequences); nothing is kept after."""
        with self._lock:
            self._closed = True
            self.budget.release_cache(self.held_bytes)
            self.held_bytes = 0

    def with_bytes(self, sequences: list[PackedSequence]) -> list[PackedSequence]:
        """Copies of the sequences whose documents hold their encoded media: a snapshot taken under
        the lock (a concurrent drop cannot pull bytes from under the decoder), and bytes that were
        not kept, or were dropped since, re-read from their shards."""
        with self._lock:
            snapshot = [[(doc, doc.media_bytes) for doc in seq.documents] for seq in sequences]
        missing: dict[str, set[str]] = defaultdict(set)
        for doc, data in (pair for seq in snapshot for pair in seq):
            if data is None and doc.media:
                missing[doc.shard].add(doc.key)
        fetched: dict[tuple[str, str], dict] = {}  # by (shard, key): datasets may reuse keys
        for url, keys in missing.items():
            fetched.update(((url, key), sample) for key, sample in self.reader.read_samples(url, keys).items())
        out = []
        for seq, pairs in zip(sequences, snapshot):
            documents = []
            for doc, data in pairs:
                if data is None and doc.media:
                    sample = fetched.get((doc.shard, doc.key), {})
                    data = {m.member: found for m in doc.media if (found := _member(sample, m.member)) is not None}
                documents.append(dataclasses.replace(doc, media_bytes=data))
            out.append(dataclasses.replace(seq, documents=documents))
        return out


def _member(sample: dict, member: str) -> bytes | None:
    """A re-read sample's member. An image member it lacks is its only image member under another
    extension (a sample planned from an img2dataset manifest names its image "jpg"; the tar may
    store png or webp): the decoder reads the format from the bytes."""
    if member in sample:
        return sample[member]
    if member not in IMAGE_EXTENSIONS:
        return None
    images = [ext for ext in sample if ext in IMAGE_EXTENSIONS]
    return sample[images[0]] if len(images) == 1 else None
