"""The sample model: a LAION-style webdataset sample parsed into a planned document.

A document is priced from metadata only (JSON, caption, image headers): its token count and
image sizes are fixed here, before any pixel is decoded, and decoding later produces exactly
these sizes. Token layout of a document: [BOS] image_0 ... image_n caption [EOS], images in
member order (``KEY.jpg`` first, then ``KEY.1.jpg``, ``KEY.2.png``, ...).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import numpy as np

from preprocess_service import imaging
from preprocess_service.config import ImageConfig
from preprocess_service.errors import SampleError
from preprocess_service.tokenizer import Tokenizer

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
_IMAGE_MEMBER = re.compile(r"^(?:(\d+)\.)?(jpg|jpeg|png|webp)$")


@dataclass(slots=True)
class ImageRef:
    """One image of a document, sized for the encoder."""

    member: str
    """Tar member extension, e.g. ``jpg`` or ``1.png``."""
    height: int
    """Resized height, pixels."""
    width: int
    tokens: int


@dataclass(slots=True)
class Document:
    """A sample accepted for planning: its token count is final."""

    key: str
    shard: str
    text_ids: np.ndarray
    """Caption token ids (int32), possibly truncated to fit the sequence."""
    images: tuple[ImageRef, ...]
    truncated: bool = False
    image_bytes: dict[str, bytes] | None = field(default=None, repr=False)
    """Encoded image members by extension; dropped once delivered, refetched from the shard if needed."""

    @property
    def image_tokens(self) -> int:
        return sum(img.tokens for img in self.images)

    @property
    def num_tokens(self) -> int:
        return 2 + self.image_tokens + len(self.text_ids)


def image_members(sample: dict) -> list[str]:
    """Image member extensions of a raw sample in document order."""
    found = []
    for ext in sample:
        match = _IMAGE_MEMBER.match(ext)
        if match:
            found.append((int(match.group(1) or 0), ext))
    return [ext for _, ext in sorted(found)]


def parse_document(sample: dict, *, image_config: ImageConfig, tokenizer: Tokenizer, seq_len: int) -> Document:
    """Turns a raw webdataset sample (``__key__``, ``__url__``, ext -> bytes) into a Document.

    Raises SampleError naming the problem for anything that makes the sample unusable.
    """
    key, shard = sample["__key__"], sample.get("__url__", "")
    try:
        meta = _parse_json(sample.get("json"))
        caption = _caption(sample, meta)
        images = tuple(_image_ref(ext, sample[ext], image_config) for ext in image_members(sample))
    except SampleError as exc:
        raise SampleError(key, exc.reason, shard, exc.kind) from None
    if not images and not caption:
        raise SampleError(key, "has neither an image nor a caption", shard, "empty")
    image_tokens = sum(img.tokens for img in images)
    room = seq_len - 2 - image_tokens
    if room < 0:
        raise SampleError(key, f"needs {image_tokens + 2} tokens for its images alone, "
                               f"more than seq_len {seq_len}", shard, "too_long")
    text_ids = tokenizer.encode(caption)
    truncated = len(text_ids) > room
    return Document(key=key, shard=shard, text_ids=text_ids[:room], images=images, truncated=truncated,
                    image_bytes={img.member: sample[img.member] for img in images})


def _parse_json(raw: bytes | None) -> dict:
    if raw is None:
        return {}
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SampleError("", f"invalid JSON metadata ({exc})", kind="invalid_json") from None
    if not isinstance(meta, dict):
        raise SampleError("", f"JSON metadata is a {type(meta).__name__}, expected an object", kind="invalid_json")
    return meta


def _caption(sample: dict, meta: dict) -> str:
    raw = sample.get("txt")
    if raw is None:
        caption = meta.get("caption") or ""
        return caption if isinstance(caption, str) else ""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SampleError("", f"caption is not valid UTF-8 ({exc})", kind="bad_utf8") from None


def _image_ref(ext: str, data: bytes, config: ImageConfig) -> ImageRef:
    try:
        header = imaging.read_header(data)
    except imaging.DecompressionBomb as exc:
        raise SampleError("", f"image {ext}: decompression bomb: {exc}", kind="decompression_bomb") from None
    except ValueError as exc:
        raise SampleError("", f"image {ext}: {exc}", kind="unreadable_image") from None
    pixels = header.width * header.height
    if pixels > config.max_source_pixels:
        raise SampleError("", f"image {ext}: decompression bomb: {header.width}x{header.height} = "
                              f"{pixels} pixels exceeds max_source_pixels {config.max_source_pixels}",
                          kind="decompression_bomb")
    if imaging.looks_truncated(data, header.format):
        raise SampleError("", f"image {ext}: truncated {header.format} file ({len(data)} bytes, no end marker)",
                          kind="truncated_image")
    height, width = imaging.target_size(header.width, header.height, config)
    return ImageRef(member=ext, height=height, width=width,
                    tokens=imaging.num_image_tokens(height, width, config))
