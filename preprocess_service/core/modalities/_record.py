"""The Modality record and the registry (modalities/__init__.py imports every modality file)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from disttrain_api.config import AudioConfig


@dataclass(frozen=True)
class Modality:
    """One kind of media in a microbatch."""

    kind: str
    """Its name: MediaItem.kind, the decoder's key (DECODERS), ``{kind}_spans`` on the wire."""
    segment: type
    """The Document segment that holds one item of it (core/sample.py)."""
    code: int
    """Its value in the microbatch's ``modality`` array (0 pad and 1 text are taken); regions of the
    output buffer and arrays on the wire come in code order."""
    placeholder: str
    """The Tokenizer attribute whose id fills its token positions."""
    region: str
    """Name of the array of its decoded items (one region of the output buffer)."""
    dtype: type
    """The decoded items' dtype."""
    slot: Callable[[Any, AudioConfig], tuple[tuple[int, ...], tuple]]
    """segment, audio config -> (the item's array shape, the decoder's params)."""
    region_shape: Callable[[list[tuple[int, ...]], int, AudioConfig], tuple[int, ...]]
    """(the items' shapes, the region's bytes, audio config) -> the region array's shape."""
    priced_by: str = "encoder"
    """Which module's cost it adds to (core/cost.py): "encoder" (each item's tokens, linear and
    quadratic) or "generator" (per item it must produce)."""
    metadata: Callable[[list[tuple[int, ...]]], dict[str, np.ndarray]] = lambda shapes: {}
    """The items' shapes -> extra arrays on the wire (image_shapes, audio_frames)."""
    check: Callable[[list[tuple[int, ...]]], None] = lambda shapes: None
    """Raises ValueError when one microbatch's items cannot share a region."""

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize


MODALITIES: dict[str, Modality] = {}
MODALITY_OF_SEGMENT: dict[type, Modality] = {}


def register(modality: Modality) -> Modality:
    """Adds ``modality``; a kind, code or segment type already registered is refused."""
    if modality.priced_by not in ("encoder", "generator"):
        raise ValueError(f"modality {modality.kind!r}: priced_by must be encoder or generator")
    if modality.kind in MODALITIES or modality.segment in MODALITY_OF_SEGMENT \
            or modality.code in {m.code for m in MODALITIES.values()} or modality.code in (0, 1):
        raise ValueError(f"modality {modality.kind!r} (code {modality.code}) clashes with a registered one")
    ordered = sorted([*MODALITIES.values(), modality], key=lambda m: m.code)  # regions in code order
    MODALITIES.clear()
    MODALITIES.update((m.kind, m) for m in ordered)
    MODALITY_OF_SEGMENT[modality.segment] = modality
    return modality


def encoder_tokens(doc) -> list[int]:
    """Token count of every item of ``doc`` an encoder reads (its modality is priced by the encoder)."""
    out = []
    for segment in doc.segments:
        media = MODALITY_OF_SEGMENT.get(type(segment))
        if media is not None and media.priced_by == "encoder":
            out.append(segment.tokens)
    return out


def num_generated(doc) -> int:
    """Items of ``doc`` the generator must produce."""
    return sum(1 for s in doc.segments if (m := MODALITY_OF_SEGMENT.get(type(s))) is not None
               and m.priced_by == "generator")
