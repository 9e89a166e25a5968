"""Image sizing (pure) and decoding: Pillow with JPEG draft-mode downscaling, uint8 RGB out.

The resized size is a function of the source size only (``target_size``), so a sample is priced
from its header before any pixel is decoded, and the decode produces exactly the planned size.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from preprocess_service.config import ImageConfig

# EXIF orientations that swap width and height (rotations by 90/270 degrees, transposes).
_SWAPPING_ORIENTATIONS = {5, 6, 7, 8}


class DecompressionBomb(ValueError):
    """The header declares more pixels than any sane image (Pillow refused to even open it)."""


@dataclass(frozen=True, slots=True)
class ImageHeader:
    """What a header read (no pixel decode) tells about an image."""

    width: int
    """Displayed width, pixels (after EXIF orientation)."""
    height: int
    format: str


def target_size(width: int, height: int, config: ImageConfig) -> tuple[int, int]:
    """(height, width) of the resized image: aspect ratio kept, both sides multiples of the token
    edge, pixel count within [min_pixels, max_pixels]. Same rule as Qwen2-VL's smart_resize."""
    factor = config.factor
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > config.max_pixels:
        beta = math.sqrt(height * width / config.max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < config.min_pixels:
        beta = math.sqrt(config.min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def num_image_tokens(height: int, width: int, config: ImageConfig) -> int:
    """Tokens of a resized image: patches / merge_size^2."""
    return (height // config.factor) * (width // config.factor)


def read_header(data: bytes) -> ImageHeader:
    """Size and format from the header only; raises ValueError on bytes that are not an image."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            orientation = img.getexif().get(0x0112, 1) if img.format in ("JPEG", "WEBP", "PNG") else 1
            fmt = img.format or "unknown"
    except Image.DecompressionBombError as exc:
        raise DecompressionBomb(str(exc)) from None
    except Exception as exc:  # Pillow raises many types for garbage bytes; all mean "not an image"
        raise ValueError(f"not a readable image ({type(exc).__name__}: {exc})") from None
    if orientation in _SWAPPING_ORIENTATIONS:
        width, height = height, width
    return ImageHeader(width=width, height=height, format=fmt)


def looks_truncated(data: bytes, fmt: str) -> bool:
    """Cheap end-marker check, so most truncated files are rejected before planning."""
    if fmt == "JPEG":
        return not data.rstrip(b"\x00").endswith(b"\xff\xd9")
    if fmt == "PNG":
        return b"IEND" not in data[-64:]
    return False


def decode_image(data: bytes, size_hw: tuple[int, int]) -> np.ndarray:
    """Decodes to uint8 RGB [H, W, 3] of exactly ``size_hw``, EXIF orientation applied.

    JPEG draft mode lets libjpeg decode at 1/2, 1/4 or 1/8 scale (DCT scaling) when the target
    is much smaller than the source, which is the main cost lever for large photos.
    """
    target_h, target_w = size_hw
    with Image.open(io.BytesIO(data)) as img:
        if img.format == "JPEG":
            orientation = img.getexif().get(0x0112, 1)
            draft_w, draft_h = (target_h, target_w) if orientation in _SWAPPING_ORIENTATIONS else (target_w, target_h)
            img.draft("RGB", (draft_w, draft_h))
        img.load()
        img = ImageOps.exif_transpose(img)
        img = _to_rgb(img)
        if img.size != (target_w, target_h):
            img = img.resize((target_w, target_h), Image.Resampling.BICUBIC)
        return np.asarray(img, dtype=np.uint8)


def _to_rgb(img: Image.Image) -> Image.Image:
    """RGB with transparency composited on white (LAION has many RGBA/P logos)."""
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")
