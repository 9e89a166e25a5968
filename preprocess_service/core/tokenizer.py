"""Tokenizer interface and the byte-level default used by the embedded demo and tests."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Tokenizer(Protocol):
    """What the packer needs from a tokenizer. Ids are int32; special ids are attributes."""

    pad_id: int
    bos_id: int
    eos_id: int
    image_id: int
    """Placeholder id at the positions of an encoder image's tokens."""
    audio_id: int
    """Placeholder id at an audio clip's tokens."""
    gen_id: int
    """Placeholder id at the query tokens of an image to generate."""
    vocab_size: int

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` as int32, without BOS/EOS."""
        ...


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0..255) plus six special ids. No download, no state."""

    pad_id = 256
    bos_id = 257
    eos_id = 258
    image_id = 259
    audio_id = 260
    gen_id = 261
    vocab_size = 262

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: np.ndarray) -> str:
        ids = np.asarray(ids)
        return bytes(ids[ids < 256].astype(np.uint8)).decode("utf-8", errors="replace")

