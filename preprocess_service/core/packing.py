"""Packing documents into fixed-length sequences (windowed best fit, deterministic)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from disttrain_api.config import CostConfig
from preprocess_service.core import modalities
from preprocess_service.core.cost import ZERO_COST, SequenceCost, price_sequence
from preprocess_service.core.sample import Document


@dataclass(slots=True)
class PackedSequence:
    """Documents that share one sequence of ``seq_len`` tokens, in token order; the rest is padding."""

    seq_len: int
    documents: list[Document] = field(default_factory=list)
    cost: SequenceCost = ZERO_COST

    @property
    def num_tokens(self) -> int:
        return sum(doc.num_tokens for doc in self.documents)

    @property
    def free_tokens(self) -> int:
        return self.seq_len - self.num_tokens


def price(sequence: PackedSequence, config: CostConfig) -> SequenceCost:
    """Prices a packed sequence from its documents' metadata (no pixels needed)."""
    return price_sequence(
        image_tokens=[t for doc in sequence.documents for t in modalities.encoder_tokens(doc)],
        document_lengths=[doc.num_tokens for doc in sequence.documents],
        num_generated_images=sum(modalities.num_generated(doc) for doc in sequence.documents),
        config=config,
    )


class Packer:
    """Best fit over ``window`` open sequences, one document at a time: each document goes into the
    open sequence with the least free space that still holds it; when none does and the window is
    full, the fullest open sequence is emitted. ``window=1`` is plain sequential packing. Every
    document is emitted exactly once; emission order is deterministic. Documents longer than
    ``seq_len`` raise ValueError. ``open`` is its whole state (the planner saves it)."""

    def __init__(self, seq_len: int, window: int, open_sequences: list[PackedSequence] | None = None):
        self.seq_len, self.window = seq_len, window
        self.open = open_sequences or []

    @property
    def open(self) -> list[PackedSequence]:
        """The open sequences, oldest first (read only: assign a new list to restore them)."""
        return self._open

    @open.setter
    def open(self, sequences: list[PackedSequence]) -> None:
        self._open = list(sequences)
        self._free = [s.free_tokens for s in self._open]
        """Free tokens of each open sequence, kept here: summing them per document cost more than
        the packing (O(window x documents per sequence x segments) per document)."""

    def add(self, doc: Document) -> list[PackedSequence]:
        """Packs ``doc``; returns the sequences this completed (0 to 2)."""
        tokens = doc.num_tokens
        if tokens > self.seq_len:
            raise ValueError(f"document {doc.key!r} has {tokens} tokens, more than seq_len {self.seq_len}")
        emitted = []
        fits = [i for i, free in enumerate(self._free) if free >= tokens]
        if fits:
            index = min(fits, key=self._free.__getitem__)  # min() keeps the earliest on ties
        else:
            if len(self._open) >= self.window:
                emitted.append(self._pop(min(range(len(self._free)), key=self._free.__getitem__)))
            self._open.append(PackedSequence(seq_len=self.seq_len))
            self._free.append(self.seq_len)
            index = len(self._open) - 1
        self._open[index].documents.append(doc)
        self._free[index] -= tokens
        if self._free[index] == 0:
            emitted.append(self._pop(index))
        return emitted

    def _pop(self, index: int) -> PackedSequence:
        del self._free[index]
        return self._open.pop(index)

    def flush(self) -> list[PackedSequence]:
        """The open sequences, in order; the packer is empty afterwards."""
        out, self.open = self._open, []
        return out


def pack_documents(documents: Iterable[Document], *, seq_len: int, window: int) -> Iterator[PackedSequence]:
    """Every document packed by a Packer, sequences in emission order, the open ones last."""
    packer = Packer(seq_len, window)
    for doc in documents:
        yield from packer.add(doc)
    yield from packer.flush()
