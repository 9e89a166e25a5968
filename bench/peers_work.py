"""The per-sample work every system of bench/peers.py does, in one place so it is the same work.

A raw webdataset sample (``__key__``, ext -> bytes) becomes a ``Prepared`` sample: the caption /
conversation / interleaved text tokenized with the byte tokenizer (int32), every image decoded and
resized to the planned size (imaging.target_size under the job's ImageConfig, EXIF orientation
applied; generation targets centre-cropped to their square), every audio clip decoded to its
log-mel frames. Planning (which members, which sizes, which tokens) is parse_document, the
service's own parser, for every system. Two image decoders:

  ours            decode.decode_item: simplejpeg DCT-scaled decode + torch antialiased bicubic (the
                  service's); with an arena (the floor) every image is resized into a reused buffer;
  pillow          Pillow at its best: Image.open, draft("RGB", size) (a JPEG is decoded at the
                  smallest DCT scale that still covers the target), exif_transpose, convert("RGB"),
                  resize(BICUBIC);
  pillow-nodraft  what users often write: the same without draft() (full-size decode).

Audio is decoded by the project's decode path in both (soundfile + torch: no peer has its own).
"""

from __future__ import annotations

import io
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from disttrain_api.config import JobConfig  # noqa: E402
from disttrain_api.errors import SampleError  # noqa: E402
from preprocess_service.core.sample import AudioRef, GenImageRef, ImageRef  # noqa: E402
from preprocess_service.core.tokenizer import ByteTokenizer  # noqa: E402

CONFIG = JobConfig(shards=("unused",))
TOKENIZER = ByteTokenizer()
DECODERS = ("ours", "pillow", "pillow-nodraft")


@dataclass(slots=True)
class Prepared:
    """One sample as delivered: uint8 [H, W, 3] images, int32 tokens, float32 audio features."""

    key: str
    tokens: np.ndarray
    images: list[np.ndarray]
    audio: list[np.ndarray]

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + sum(a.nbytes for a in self.images) + sum(a.nbytes for a in self.audio)


EMPTY = Prepared("", np.zeros(0, np.int32), [], [])
"""A sample left out (the fixed-schema systems still deliver a row for it, marked not ok)."""


class ArenaFull(Exception):
    """The floor's arena is too small for one sample's images (a bench error, never a skip)."""


def prepare(sample: dict, decoder: str = "ours", arena: np.ndarray | None = None) -> Prepared | None:
    """The sample's work; None for a sample the service would skip (unparsable or undecodable).
    With ``arena`` (uint8, decoder "ours") the images are resized into consecutive slices of it and
    the returned images are views, valid until the next call with the same arena."""
    from preprocess_service.adapters.decode import decode_item
    from preprocess_service.adapters.media.parse import parse_document

    try:
        doc = parse_document(sample, image_config=CONFIG.image, tokenizer=TOKENIZER, seq_len=CONFIG.seq_len,
                             audio_config=CONFIG.audio, generation=CONFIG.generation)
    except SampleError:
        return None
    ids = [s.ids for s in doc.segments if hasattr(s, "ids")]
    tokens = np.concatenate(ids).astype(np.int32, copy=False) if ids else np.zeros(0, np.int32)
    images, audio, used = [], [], 0
    try:
        for seg in doc.media:
            data = doc.media_bytes[seg.member]  # type: ignore[index]
            if isinstance(seg, AudioRef):
                audio.append(decode_item("audio", data, (seg.frames, CONFIG.audio)))
            elif decoder != "ours":
                images.append(_pillow(data, seg, draft=decoder == "pillow"))
            else:
                kind, shape, params = (("image", (seg.height, seg.width, 3), (seg.height, seg.width, seg.orientation))
                                       if isinstance(seg, ImageRef) else
                                       ("gen", (seg.size, seg.size, 3), (seg.size, seg.orientation)))
                out = None
                if arena is not None:
                    if used + int(np.prod(shape)) > arena.nbytes:
                        raise ArenaFull(f"{doc.key}: its images need more than the arena's {arena.nbytes} bytes")
                    out = np.ndarray(shape, np.uint8, buffer=arena, offset=used)
                    used += out.nbytes
                images.append(decode_item(kind, data, params, out))
    except ArenaFull:
        raise
    except Exception:  # undecodable member: the service reports and skips the sample
        return None
    return Prepared(doc.key, tokens, images, audio)


def _pillow(data: bytes, seg, draft: bool) -> np.ndarray:
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(data)) as img:
        if draft:  # the size as stored: EXIF orientations 5-8 swap width and height
            width, height = (seg.size, seg.size) if isinstance(seg, GenImageRef) else (seg.width, seg.height)
            img.draft("RGB", (height, width) if seg.orientation in (5, 6, 7, 8) else (width, height))
        rgb = ImageOps.exif_transpose(img).convert("RGB")
        if isinstance(seg, GenImageRef):
            return np.asarray(ImageOps.fit(rgb, (seg.size, seg.size), Image.Resampling.BICUBIC))
        assert isinstance(seg, ImageRef)
        return np.asarray(rgb.resize((seg.width, seg.height), Image.Resampling.BICUBIC))


def flatten(p: Prepared) -> dict[str, np.ndarray | str]:
    """Fixed-schema form for systems that need columns (tf.data, Ray): images as one uint8 buffer
    plus an int32 [n, 3] shape table, audio likewise."""
    return {"key": p.key, "tokens": p.tokens,
            "pixels": np.concatenate([a.reshape(-1) for a in p.images]) if p.images else np.zeros(0, np.uint8),
            "image_shapes": np.array([a.shape for a in p.images], np.int32).reshape(-1, 3),
            "audio": np.concatenate([a.reshape(-1) for a in p.audio]) if p.audio else np.zeros(0, np.float32),
            "audio_shapes": np.array([a.shape for a in p.audio], np.int32).reshape(-1, 2)}
