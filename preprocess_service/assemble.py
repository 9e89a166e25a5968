"""Turns the packed sequences of one microbatch into its arrays (the wire layout in the .proto).

Documents are decoded here, after planning. A document whose image fails to decode is left out
(its tokens become padding) and reported; the rest of the microbatch is unaffected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from preprocess_service.imaging import decode_image
from preprocess_service.packing import PackedSequence
from preprocess_service.sample import Document
from preprocess_service.tokenizer import Tokenizer

MODALITY_PAD, MODALITY_TEXT, MODALITY_IMAGE = 0, 1, 2


@dataclass(slots=True)
class MicrobatchArrays:
    """Named arrays of one microbatch plus provenance."""

    arrays: dict[str, np.ndarray]
    sample_keys: list[str]
    skipped: list[tuple[str, str, str]] = field(default_factory=list)
    """(key, shard, reason) of documents that failed to decode."""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def _decode_document(doc: Document) -> list[np.ndarray]:
    """Pixels of every image of ``doc``; raises on anything that makes the document unusable."""
    data = doc.image_bytes or {}
    missing = [img.member for img in doc.images if data.get(img.member) is None]
    if missing:
        raise LookupError(f"encoded image(s) {missing} not found when re-reading the shard (did it change "
                          "after planning?)")
    return [decode_image(data[img.member], (img.height, img.width)) for img in doc.images]


def _try_decode(doc: Document) -> list[np.ndarray] | Exception:
    try:
        return _decode_document(doc)
    except (MemoryError, ImportError):
        raise
    except Exception as exc:  # any decoder failure means this sample is unusable
        return exc


def assemble_microbatch(sequences: list[PackedSequence], *, seq_len: int, tokenizer: Tokenizer,
                        map_fn: Callable = map) -> MicrobatchArrays:
    """``map_fn`` decodes the documents (e.g. a thread pool's map: Pillow releases the GIL while it
    decodes and resizes); results are used in document order, so the output does not depend on it."""
    decoded = iter(list(map_fn(_try_decode, [doc for seq in sequences for doc in seq.documents])))
    num_seqs = len(sequences)
    tokens = np.full((num_seqs, seq_len), tokenizer.pad_id, dtype=np.int32)
    positions = np.zeros((num_seqs, seq_len), dtype=np.int32)
    modality = np.zeros((num_seqs, seq_len), dtype=np.uint8)
    cu_seqlens, segment_doc = [0], []
    spans, shapes, pixels = [], [], []
    out = MicrobatchArrays(arrays={}, sample_keys=[])
    for s, seq in enumerate(sequences):
        offset = 0
        for doc in seq.documents:
            images = next(decoded)
            if isinstance(images, Exception):
                exc = images
                out.skipped.append((doc.key, doc.shard, f"image decode failed: {type(exc).__name__}: {exc}"))
                continue
            base = s * seq_len + offset
            cursor = offset
            tokens[s, cursor] = tokenizer.bos_id
            cursor += 1
            for ref, array in zip(doc.images, images):
                tokens[s, cursor:cursor + ref.tokens] = tokenizer.image_id
                modality[s, cursor:cursor + ref.tokens] = MODALITY_IMAGE
                spans.append((s * seq_len + cursor, s * seq_len + cursor + ref.tokens))
                shapes.append(array.shape)
                pixels.append(array.reshape(-1))
                cursor += ref.tokens
            text_end = cursor + len(doc.text_ids)
            tokens[s, cursor:text_end] = doc.text_ids
            modality[s, cursor:text_end] = MODALITY_TEXT
            tokens[s, text_end] = tokenizer.eos_id
            modality[s, text_end] = MODALITY_TEXT
            modality[s, offset] = MODALITY_TEXT
            positions[s, offset:text_end + 1] = np.arange(text_end + 1 - offset)
            offset = text_end + 1
            cu_seqlens.append(s * seq_len + offset)
            segment_doc.append(len(out.sample_keys))
            out.sample_keys.append(doc.key)
            assert s * seq_len + offset - base == doc.num_tokens
        if offset < seq_len:
            cu_seqlens.append((s + 1) * seq_len)
            segment_doc.append(-1)
    out.arrays = {
        "tokens": tokens,
        "position_ids": positions,
        "modality": modality,
        "cu_seqlens": np.array(cu_seqlens, dtype=np.int32),
        "segment_doc": np.array(segment_doc, dtype=np.int32),
        "image_spans": np.array(spans, dtype=np.int32).reshape(-1, 2),
        "image_shapes": np.array(shapes, dtype=np.int32).reshape(-1, 3),
        "pixels": np.concatenate(pixels) if pixels else np.zeros(0, dtype=np.uint8),
    }
    return out
