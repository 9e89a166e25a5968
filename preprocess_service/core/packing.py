"""Packing documents into fixed-length sequences (windowed best fit, deterministic)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from disttrain_api.config import CostConfig
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
        image_tokens=[t for doc in sequence.documents for t in doc.encoder_tokens],
        document_lengths=[doc.num_tokens for doc in sequence.documents],
        num_generated_images=sum(len(doc.generated) for doc in sequence.documents),
        config=config,
    )


def pack_documents(documents: Iterable[Document], *, seq_len: int, window: int) -> Iterator[PackedSequence]:
    """Best fit over ``window`` open sequences: each document goes into the open sequence with the
    least free space that still holds it; when none does and the window is full, the fullest open
    sequence is emitted. ``window=1`` is plain sequential packing. Every document is emitted exactly
    once; emission order is deterministic. Documents longer than ``seq_len`` raise ValueError."""
    open_seqs: list[PackedSequence] = []
    for doc in documents:
        if doc.num_tokens > seq_len:
            raise ValueError(f"document {doc.key!r} has {doc.num_tokens} tokens, more than seq_len {seq_len}")
        fits = [s for s in open_seqs if s.free_tokens >= doc.num_tokens]
        if fits:
            target = min(fits, key=lambda s: s.free_tokens)  # min() keeps the earliest on ties
        else:
            if len(open_seqs) >= window:
                fullest = min(open_seqs, key=lambda s: s.free_tokens)
                open_seqs.remove(fullest)
                yield fullest
            target = PackedSequence(seq_len=seq_len)
            open_seqs.append(target)
        target.documents.append(doc)
        if target.free_tokens == 0:
            open_seqs.remove(target)
            yield target
    yield from open_seqs
