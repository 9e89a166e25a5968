"""Image sizing (pure) and decoding: libjpeg-turbo DCT-scaled JPEG decode, Pillow for the rest, uint8 RGB out.

The resized size is a function of the source size only (``target_size``), so a sample is priced
from its header before any pixel is decoded, and the decode produces exactly the planned size.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import simplejpeg
from PIL import Image

from disttrain_api.config import ImageConfig

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
    orientation: int = 1
    """EXIF orientation (1 = as stored)."""


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
            orientation = _orientation(img)
            fmt = img.format or "unknown"
    except Image.DecompressionBombError as exc:
        raise DecompressionBomb(str(exc)) from None
    except Exception as exc:  # Pillow raises many types for garbage bytes; all mean "not an image"
        raise ValueError(f"not a readable image ({type(exc).__name__}: {exc})") from None
    if orientation in _SWAPPING_ORIENTATIONS:
        width, height = height, width
    return ImageHeader(width=width, height=height, format=fmt, orientation=int(orientation))


def looks_truncated(data: bytes, fmt: str) -> bool:
    """Cheap end-marker check, so most truncated files are rejected before planning."""
    if fmt == "JPEG":
        return not data.rstrip(b"\x00").endswith(b"\xff\xd9")
    if fmt == "PNG":
        return b"IEND" not in data[-64:]
    return False


def orientation_of(data: bytes) -> int:
    """EXIF orientation (1-8, 1 = as stored) of an encoded image; 1 when it has none."""
    with Image.open(io.BytesIO(data)) as img:
        return _orientation(img)


def _orientation(img: Image.Image) -> int:
    """EXIF orientation without decoding pixels. Pillow's getexif() on a PNG whose eXIf chunk is not
    before the image data decodes the whole image to look for it (a 493 KB PNG bomb costs seconds
    and gigabytes), so a PNG only uses an eXIf chunk found with the header."""
    if img.format == "PNG":
        raw = img.info.get("exif")
        if not raw:
            return 1
        exif = Image.Exif()
        exif.load(raw)
        return int(exif.get(0x0112, 1))
    return int(img.getexif().get(0x0112, 1))  # any other format: MPO (camera JPEG), TIFF-like, ...


def decode_image(data: bytes, size_hw: tuple[int, int], orientation: int | None = None,
                 out: np.ndarray | None = None) -> np.ndarray:
    """Decodes to uint8 RGB [H, W, 3] of exactly ``size_hw``, EXIF orientation applied; into
    ``out`` (uint8 [H, W, 3], e.g. a slot of shared memory) when given, which is returned.

    ``orientation`` is the EXIF orientation read at planning (read again when None). The pixels are
    decoded at the smallest JPEG DCT scale (1/2, 1/4, 1/8) that still covers the target, then
    resized with an antialiased bicubic filter (bench/decode.py measures the alternatives).
    """
    if orientation is None:
        orientation = orientation_of(data)
    target_h, target_w = size_hw
    swapped = orientation in _SWAPPING_ORIENTATIONS
    stored_hw = (target_w, target_h) if swapped else (target_h, target_w)
    pixels = _orient(decode_rgb(data, min_hw=stored_hw), orientation)
    return resize(pixels, size_hw, out)


def decode_square(data: bytes, size: int, orientation: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """uint8 RGB [size, size, 3]: the centred square crop of the displayed image, resized (the usual
    preparation of a diffusion model's training target); into ``out`` when given."""
    if orientation is None:
        orientation = orientation_of(data)
    pixels = _orient(decode_rgb(data, min_hw=(size, size)), orientation)
    height, width = pixels.shape[:2]
    side = min(height, width)
    top, left = (height - side) // 2, (width - side) // 2
    return resize(pixels[top:top + side, left:left + side], (size, size), out)


def decode_rgb(data: bytes, *, min_hw: tuple[int, int]) -> np.ndarray:
    """uint8 RGB [h, w, 3] as stored (no EXIF rotation), for JPEG at the smallest DCT scale (1, 1/2,
    1/4, 1/8) with h >= min_hw[0] and w >= min_hw[1]. JPEGs in YCbCr, gray or RGB go through libjpeg-turbo directly
    (simplejpeg); CMYK/YCCK JPEGs (Adobe inversion) and every other format go through Pillow."""
    if data[:3] == b"\xff\xd8\xff":
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        if colorspace in ("YCbCr", "Gray", "RGB"):
            # Only power-of-two scales: libjpeg-turbo's M/8 scales (3/8, 5/8, ...) lose visible quality.
            scale = max([s for s in (1, 2, 4, 8) if -(-height // s) >= min_hw[0] and -(-width // s) >= min_hw[1]],
                        default=1)
            return simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=-(-height // scale),
                                          min_width=-(-width // scale))
    with Image.open(io.BytesIO(data)) as img:
        if img.format == "JPEG":
            img.draft("RGB", (min_hw[1], min_hw[0]))
        img.load()
        return np.array(_to_rgb(img), dtype=np.uint8)  # writable: torch refuses read-only arrays


def resize(pixels: np.ndarray, size_hw: tuple[int, int], out: np.ndarray | None = None) -> np.ndarray:
    """Antialiased bicubic resize of uint8 [h, w, 3] (torch's uint8 SIMD kernel, which was written
    to match Pillow's filter and is faster than Pillow's resize: bench/decode.py part 1); a no-op at
    the same size.
    With ``out`` (uint8 [H, W, 3]) the result is written there, and ``out`` returned: a decode
    worker resizes straight into the microbatch's shared memory instead of copying the pixels in."""
    if pixels.shape[:2] == tuple(size_hw):
        if out is None:
            return pixels
        out[...] = pixels
        return out
    import torch  # here, not at the top: the planner reads image headers and never decodes

    source = torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).unsqueeze(0)
    resized = torch.nn.functional.interpolate(source, size=tuple(size_hw), mode="bicubic", antialias=True)
    # The kernel writes NCHW; torch's channels-last copy is faster than numpy's strided one.
    if out is None:
        return resized.contiguous(memory_format=torch.channels_last)[0].permute(1, 2, 0).numpy()
    torch.from_numpy(out).permute(2, 0, 1).copy_(resized[0])  # the same copy, into place
    return out


def _orient(pixels: np.ndarray, orientation: int) -> np.ndarray:
    """Applies an EXIF orientation to stored pixels (same result as ImageOps.exif_transpose)."""
    if orientation in (2, 4, 5, 7):  # mirrored variants: flip left-right first
        pixels = pixels[:, ::-1]
    turns = {3: 2, 4: 2, 5: 1, 6: 3, 7: 3, 8: 1}.get(orientation, 0)  # counter-clockwise quarter turns
    # a copy, not ascontiguousarray: a view one pixel wide counts as contiguous with its negative
    # stride kept, which torch refuses
    return np.rot90(pixels, turns).copy() if turns or orientation == 2 else pixels


def _to_rgb(img: Image.Image) -> Image.Image:
    """RGB by one rule: 16-bit grey reduced to its high byte (as Pillow itself reduces 16-bit RGB,
    RGBA and grey+alpha PNGs; Pillow's convert would clip it at 255, turning most of the picture
    white); any transparency, an alpha band or a tRNS entry (palette alpha or a grey or RGB colour
    key), composited on white (LAION has many RGBA/P logos); everything else, CMYK and YCCK JPEGs
    included, by Pillow's convert."""
    if img.mode in _SIXTEEN_BIT_GREY:
        img = _high_byte(img)
    if "A" in img.getbands() or "transparency" in img.info:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


_SIXTEEN_BIT_GREY = ("I;16", "I;16B", "I;16L", "I;16N", "I")
"""Pillow's modes of 16-bit grey ("I": 32-bit integers, taken as 16-bit: clipped to 0-65535)."""


def _high_byte(img: Image.Image) -> Image.Image:
    """L (LA with a tRNS key: alpha 0 where the 16-bit value is the key) of 16-bit grey."""
    values = np.asarray(img)
    grey = Image.fromarray((np.clip(values, 0, 65535) >> 8).astype(np.uint8), "L")
    key = img.info.get("transparency")
    if key is None:
        return grey
    return Image.merge("LA", (grey, Image.fromarray(np.where(values == key, 0, 255).astype(np.uint8), "L")))
