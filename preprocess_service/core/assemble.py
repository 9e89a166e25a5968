"""Lays out one microbatch (the wire layout in the .proto) before anything is decoded.

Every size is known from planning, so ``layout_microbatch`` computes the token arrays and, for
each document, where each decoded image, mel and generation target goes in one flat output
buffer. A decode stage (adapters/decode/) then fills that buffer: workers write straight into their
slots, so the result is the same whatever order they finish in. A document that fails to decode
is left out by laying the microbatch out again without it (its tokens become padding, its loss
mask 0) and moving the other documents' decoded bytes over (``compact``); it is reported, and
the rest of the microbatch is unaffected.

The text loss's mask is laid out with the tokens: position i is trained to predict token i + 1
only when that is a trainable text token, or the EOS of a document that trains it
(Document.trains_eos), of the same document. So nothing predicts a placeholder, BOS or padding,
and nothing is predicted across a document boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import numpy as np

from disttrain_api.config import AudioConfig
from preprocess_service.core.modalities import MODALITIES, MODALITY_OF_SEGMENT
from preprocess_service.core.packing import PackedSequence
from preprocess_service.core.sample import Document, TextSegment
from preprocess_service.core.tokenizer import Tokenizer

MODALITY_PAD, MODALITY_TEXT, MODALITY_IMAGE, MODALITY_AUDIO, MODALITY_GEN = 0, 1, 2, 3, 4
_ALIGN = 64


@dataclass(slots=True)
class MediaItem:
    """One member to decode and the slot of the output buffer its array goes to."""

    kind: str
    """Its modality (core/modalities/): "image" (uint8 [h, w, 3]), "audio" (float16 [frames, n_mels]),
    "gen" (uint8 [size, size, 3]), ..."""
    member: str
    params: tuple
    """What its decoder needs (the modality's ``slot``): image (height, width, orientation), ..."""
    offset: int
    """Byte offset of the slot in the output buffer."""
    nbytes: int
    shape: tuple[int, ...]
    """The slot's array shape (uint8 images, float16 audio)."""


@dataclass(slots=True)
class Layout:
    """A microbatch's token arrays and the output slots of its media, before decoding."""

    arrays: dict[str, np.ndarray]
    sample_keys: list[str]
    documents: list[tuple[Document, list[MediaItem]]]
    """Every document laid out, in token order, with its media items."""
    regions: dict[str, tuple[int, int, tuple]]
    """region name (pixels, mel, gen_pixels, ...) -> (byte offset, byte count, shape) in the output buffer."""
    nbytes: int
    """Size of the output buffer."""

    def media_arrays(self, buffer: np.ndarray) -> dict[str, np.ndarray]:
        """Each modality's region as a view of a filled output buffer (uint8 [nbytes])."""
        dtypes = {m.region: m.dtype for m in MODALITIES.values()}
        return {name: buffer[start:start + count].view(dtypes[name]).reshape(shape)
                for name, (start, count, shape) in self.regions.items()}


@dataclass(slots=True)
class MicrobatchArrays:
    """Named arrays of one microbatch plus provenance."""

    arrays: dict[str, np.ndarray]
    sample_keys: list[str]
    sample_datasets: list[int] = field(default_factory=list)
    """The dataset (JobConfig.mixture() index) of each of sample_keys."""
    skipped: list = field(default_factory=list)
    """report.SkippedRecord (key, shard, reason, kind) of each document that failed to decode."""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def aligned(n: int) -> int:
    """``n`` rounded up to the alignment of every array in an output buffer (64 bytes)."""
    return -(-n // _ALIGN) * _ALIGN


def layout_microbatch(sequences: list[PackedSequence], *, seq_len: int, tokenizer: Tokenizer,
                      audio_config: AudioConfig, skip: frozenset[str] = frozenset()) -> Layout:
    """Token arrays and media slots of ``sequences``; documents whose key is in ``skip`` are left
    out. Each media segment is placed by its modality's record (core/modalities/)."""
    num_seqs = len(sequences)
    tokens = np.full((num_seqs, seq_len), tokenizer.pad_id, dtype=np.int32)
    positions = np.zeros((num_seqs, seq_len), dtype=np.int32)
    modality = np.zeros((num_seqs, seq_len), dtype=np.uint8)
    loss_mask = np.zeros((num_seqs, seq_len), dtype=np.uint8)
    cu_seqlens, segment_doc, documents = [0], [], []
    keys: list[str] = []
    spans: dict[str, list] = {kind: [] for kind in MODALITIES}
    shapes: dict[str, list] = {kind: [] for kind in MODALITIES}
    sizes = dict.fromkeys(MODALITIES, 0)  # bytes per region so far
    placeholders = {kind: getattr(tokenizer, m.placeholder) for kind, m in MODALITIES.items()}
    for s, seq in enumerate(sequences):
        offset = 0
        for doc in seq.documents:
            if doc.key in skip:
                continue
            row, cursor, items = tokens[s], offset + 1, []
            row[offset] = tokenizer.bos_id
            modality[s, offset] = MODALITY_TEXT
            for segment in doc.segments:
                end = cursor + segment.tokens
                media = MODALITY_OF_SEGMENT.get(type(segment))
                if media is None:  # a TextSegment
                    text = cast(TextSegment, segment)
                    row[cursor:end] = text.ids
                    modality[s, cursor:end] = MODALITY_TEXT
                    if text.trainable:  # position i is trained to predict token i + 1
                        loss_mask[s, cursor - 1:end - 1] = 1
                else:
                    kind = media.kind
                    row[cursor:end] = placeholders[kind]
                    modality[s, cursor:end] = media.code
                    spans[kind].append((s * seq_len + cursor, s * seq_len + end))
                    shape, params = media.slot(segment, audio_config)
                    shapes[kind].append(shape)
                    nbytes = int(np.prod(shape)) * media.itemsize
                    items.append(MediaItem(kind, segment.member, params, sizes[kind], nbytes, shape))
                    sizes[kind] += nbytes
                cursor = end
            row[cursor] = tokenizer.eos_id
            modality[s, cursor] = MODALITY_TEXT
            loss_mask[s, cursor - 1] = doc.trains_eos
            positions[s, offset:cursor + 1] = np.arange(cursor + 1 - offset)
            offset = cursor + 1
            cu_seqlens.append(s * seq_len + offset)
            segment_doc.append(len(keys))
            keys.append(doc.key)
            documents.append((doc, items))
        if offset < seq_len:
            cu_seqlens.append((s + 1) * seq_len)
            segment_doc.append(-1)
    # One output buffer: one aligned region per modality, in code order; item offsets become absolute.
    starts, end_of_buffer = {}, 0
    for kind, media in MODALITIES.items():
        media.check(shapes[kind])
        starts[kind], end_of_buffer = end_of_buffer, end_of_buffer + aligned(sizes[kind])
    for _, items in documents:
        for item in items:
            item.offset += starts[item.kind]
    regions = {media.region: (starts[kind], sizes[kind], media.region_shape(shapes[kind], sizes[kind], audio_config))
               for kind, media in MODALITIES.items()}
    arrays: dict[str, np.ndarray] = {
        "tokens": tokens, "position_ids": positions, "modality": modality, "loss_mask": loss_mask,
        "cu_seqlens": np.array(cu_seqlens, dtype=np.int32), "segment_doc": np.array(segment_doc, dtype=np.int32),
    }
    for kind, media in MODALITIES.items():
        arrays[f"{kind}_spans"] = np.array(spans[kind], dtype=np.int32).reshape(-1, 2)
        arrays.update(media.metadata(shapes[kind]))
    return Layout(arrays=arrays, sample_keys=keys, documents=documents, regions=regions, nbytes=end_of_buffer)


def compact(old: Layout, old_buffer: np.ndarray, new: Layout) -> np.ndarray:
    """The output buffer of ``new`` (a layout of a subset of ``old``'s documents), filled from ``old_buffer``."""
    buffer = np.empty(new.nbytes, dtype=np.uint8)
    old_items = {doc.key: items for doc, items in old.documents}
    for doc, items in new.documents:
        for item, source in zip(items, old_items[doc.key]):
            buffer[item.offset:item.offset + item.nbytes] = old_buffer[source.offset:source.offset + source.nbytes]
    return buffer


def finish(layout: Layout, buffer: np.ndarray) -> MicrobatchArrays:
    """The microbatch's arrays: token arrays plus media views of the filled ``buffer``."""
    return MicrobatchArrays(arrays={**layout.arrays, **layout.media_arrays(buffer)}, sample_keys=layout.sample_keys,
                            sample_datasets=[doc.dataset for doc, _ in layout.documents])
