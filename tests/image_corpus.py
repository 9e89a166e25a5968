"""A corpus of every image class real web data has, written as img2dataset writes it.

Each class is one sample whose key names the class (``jpeg_orient6``, ``png_i16``, ...), so a test
that fails on one names it. The pictures are textured and asymmetric (every flip or quarter turn
changes them a lot), with alpha where the class has one (transparent, half transparent, a ramp).
``write_corpus`` writes one tar per image format (img2dataset's ``encode_format``: .jpg, .png or
.webp members), each with KEY.txt and KEY.json, and beside it the NNNNN.parquet of
img2dataset's "keep the original bytes" mode (``width``/``height`` as stored, EXIF orientation not
applied) and NNNNN_stats.json. Everything is made here with Pillow and numpy, except the YCCK
JPEG, which Pillow cannot write: its planes are computed here and written through Pillow's CMYK
encoder, then its Adobe marker is set to "YCCK" (``_ycck_jpeg``).
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import webdataset as wds
from PIL import Image

PARQUET_SCHEMA = pa.schema([  # img2dataset's writer.py, in its column order
    ("url", pa.string()), ("caption", pa.string()), ("key", pa.string()), ("status", pa.string()),
    ("error_message", pa.string()), ("width", pa.int32()), ("height", pa.int32()),
    ("original_width", pa.int32()), ("original_height", pa.int32()), ("exif", pa.string()), ("sha256", pa.string()),
])
SHARD_OF_EXT = {"jpg": 0, "png": 1, "webp": 2}
"""Shard number of each image format (one format per shard, as img2dataset writes)."""


@dataclass(frozen=True)
class ImageClass:
    """One class of the corpus: its member extension and how its bytes are made."""

    ext: str
    make: Callable[[], bytes]
    exif: str | None = None
    """What img2dataset's ``exif`` column says (JSON of the EXIF tags it read), if anything."""


def textured(width: int, height: int, *, seed: int = 0, alpha: bool = False) -> Image.Image:
    """An asymmetric RGB(A) picture: smooth waves, random blobs and hard 6 px blocks (edges tell
    resize filters apart). With ``alpha``: transparent top quarter, half transparent second
    quarter, a left-to-right ramp below."""
    rng = np.random.default_rng(seed)
    x = np.arange(width, dtype=np.float32)[None, :]
    y = np.arange(height, dtype=np.float32)[:, None]
    out = np.empty((height, width, 3), dtype=np.float32)
    out[..., 0] = 50 * np.sin(x / 17.0 + seed)
    out[..., 1] = 50 * np.cos(y / 23.0)
    out[..., 2] = 45 * (np.sin(x / 31.0) * np.cos(y / 31.0) + np.cos(x / 31.0) * np.sin(y / 31.0))  # sin((x+y)/31)
    out += 63.5  # waves at half weight: 0.5 * (127 + 100 sin) and so on
    out += 0.35 * np.asarray(Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8))
                             .resize((width, height), Image.Resampling.BILINEAR), dtype=np.float32)
    cells = rng.integers(0, 255, (height // 6 + 1, width // 6 + 1, 3)).astype(np.float32)
    out += 0.15 * np.repeat(np.repeat(cells, 6, axis=0), 6, axis=1)[:height, :width]
    img = Image.fromarray(np.clip(out, 0, 255).astype(np.uint8))
    if alpha:
        a = np.repeat(np.clip(x / max(width - 1, 1) * 255, 0, 255).astype(np.uint8), height, axis=0)
        a[: height // 4] = 0
        a[height // 4: height // 2] = 128
        img.putalpha(Image.fromarray(a))
    return img


def _save(img: Image.Image, fmt: str, **kwargs) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **kwargs)
    return out.getvalue()


def _oriented_jpeg(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _save(textured(1200, 800, seed=orientation), "JPEG", quality=90, exif=exif)


def _ycck_jpeg(width: int, height: int, seed: int) -> bytes:
    """An Adobe YCCK JPEG whose CMYK (as Pillow reads it) is Pillow's CMYK of ``textured``.

    libjpeg turns YCCK into CMYK as C = 255 - R(Y, Cb, Cr) (JFIF's YCbCr -> RGB), M and Y alike,
    K as stored; Pillow then inverts all four (Adobe CMYK is stored inverted). So for a wanted
    Pillow CMYK (c, m, y, k) the stored planes are YCbCr(c, m, y) and 255 - k. Pillow's CMYK
    encoder stores 255 - value (it writes inverted Adobe CMYK, transform 0), so it is given
    255 - planes, and the transform byte is then set to 2 (YCCK)."""
    wanted = np.asarray(textured(width, height, seed=seed).convert("CMYK")).astype(np.float64)
    c, m, y, k = np.moveaxis(wanted, -1, 0)
    planes = np.stack([0.299 * c + 0.587 * m + 0.114 * y,
                       -0.168736 * c - 0.331264 * m + 0.5 * y + 128,
                       0.5 * c - 0.418688 * m - 0.081312 * y + 128,
                       255 - k], axis=-1)
    stored = Image.fromarray(np.clip(np.rint(255 - planes), 0, 255).astype(np.uint8), "CMYK")
    data = bytearray(_save(stored, "JPEG", quality=95))
    adobe = data.find(b"\xff\xee\x00\x0eAdobe")
    transform = adobe + 4 + 11  # marker, length, "Adobe", version (2), flags0 (2), flags1 (2)
    assert adobe > 0 and data[transform] == 0, "Pillow's CMYK JPEG has no Adobe marker where expected"
    data[transform] = 2
    return bytes(data)


def _png16(pixels: np.ndarray, color_type: int) -> bytes:
    """A 16-bit PNG written by hand (Pillow writes 16-bit grey only): ``pixels`` uint16 [H, W, C],
    colour type 2 (RGB), 4 (grey+alpha) or 6 (RGBA)."""
    height, width = pixels.shape[:2]
    rows = pixels.astype(">u2").reshape(height, -1).tobytes()
    stride = len(rows) // height
    raw = b"".join(b"\x00" + rows[i * stride:(i + 1) * stride] for i in range(height))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 16, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def _widen(img: Image.Image, seed: int) -> np.ndarray:
    """uint16 of an 8-bit picture, with low bytes that are noise (only the high byte is the picture)."""
    pixels = np.asarray(img).astype(np.uint16)
    return pixels * 256 + np.random.default_rng(seed).integers(0, 256, pixels.shape, dtype=np.uint16)


def _i16_png() -> bytes:
    grey = np.asarray(textured(500, 350, seed=30).convert("L")).astype(np.uint16)
    return _save(Image.fromarray(grey * 257), "PNG")  # the full 16-bit range: clipping would show at once


def _palette_png(*, transparency: str | None) -> bytes:
    img = textured(500, 350, seed=31, alpha=transparency == "alpha")
    if transparency == "alpha":  # pngquant-like: per-entry alpha (tRNS with partial values)
        quantized = img.quantize(255, method=Image.Quantize.FASTOCTREE)
        return _save(quantized, "PNG")
    quantized = img.quantize(255)
    if transparency is None:
        return _save(quantized, "PNG")
    indices = np.asarray(quantized).copy()
    indices[: 350 // 3, : 500 // 2] = 255  # one fully transparent palette entry, over a block
    out = Image.fromarray(indices, "P")
    out.putpalette(quantized.getpalette())
    return _save(out, "PNG", transparency=255)


def _keyed_png(mode: str) -> bytes:
    """L or RGB with a tRNS colour key: the pixels of that one value are transparent."""
    img = textured(500, 350, seed=32).convert(mode)
    pixels = np.asarray(img).copy()
    key = 0 if mode == "L" else (0, 0, 0)
    pixels[pixels == 0] = 1  # the key only where it is put on purpose
    pixels[100:200, 50:250] = key
    return _save(Image.fromarray(pixels, mode), "PNG", transparency=key)


def _png_with_exif(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _save(textured(600, 400, seed=33), "PNG", exif=exif)


CLASSES: dict[str, ImageClass] = {
    **{f"jpeg_orient{o}": ImageClass("jpg", lambda o=o: _oriented_jpeg(o), exif=json.dumps(
        {"Image Orientation": str(o)})) for o in range(1, 9)},
    "jpeg_cmyk": ImageClass("jpg", lambda: _save(textured(500, 350, seed=10).convert("CMYK"), "JPEG", quality=90)),
    "jpeg_ycck": ImageClass("jpg", lambda: _ycck_jpeg(500, 350, seed=11)),
    "jpeg_grey": ImageClass("jpg", lambda: _save(textured(500, 350, seed=12).convert("L"), "JPEG", quality=90)),
    "jpeg_progressive": ImageClass("jpg", lambda: _save(textured(700, 500, seed=13), "JPEG", quality=90,
                                                        progressive=True)),
    "jpeg_huge": ImageClass("jpg", lambda: _save(textured(4000, 3000, seed=14), "JPEG", quality=90)),
    "jpeg_tiny_1x1": ImageClass("jpg", lambda: _save(textured(1, 1, seed=15), "JPEG", quality=90)),
    "jpeg_tiny_3x2": ImageClass("jpg", lambda: _save(textured(3, 2, seed=16), "JPEG", quality=90)),
    "jpeg_wide_2000x20": ImageClass("jpg", lambda: _save(textured(2000, 20, seed=17), "JPEG", quality=90)),
    "jpeg_tall_20x2000": ImageClass("jpg", lambda: _save(textured(20, 2000, seed=18), "JPEG", quality=90)),
    "png_rgb": ImageClass("png", lambda: _save(textured(500, 350, seed=20), "PNG")),
    "png_rgba": ImageClass("png", lambda: _save(textured(500, 350, seed=21, alpha=True), "PNG")),
    "png_palette": ImageClass("png", lambda: _palette_png(transparency=None)),
    "png_palette_trns": ImageClass("png", lambda: _palette_png(transparency="key")),
    "png_palette_alpha": ImageClass("png", lambda: _palette_png(transparency="alpha")),
    "png_grey": ImageClass("png", lambda: _save(textured(500, 350, seed=22).convert("L"), "PNG")),
    "png_grey_trns": ImageClass("png", lambda: _keyed_png("L")),
    "png_rgb_trns": ImageClass("png", lambda: _keyed_png("RGB")),
    "png_la": ImageClass("png", lambda: _save(textured(500, 350, seed=23, alpha=True).convert("LA"), "PNG")),
    "png_i16": ImageClass("png", _i16_png),
    "png_rgb16": ImageClass("png", lambda: _png16(_widen(textured(500, 350, seed=24), 24), 2)),
    "png_rgba16": ImageClass("png", lambda: _png16(_widen(textured(500, 350, seed=25, alpha=True), 25), 6)),
    "png_la16": ImageClass("png", lambda: _png16(_widen(textured(500, 350, seed=26, alpha=True).convert("LA"), 26),
                                                 4)),
    "png_orient6": ImageClass("png", lambda: _png_with_exif(6), exif=json.dumps({"Image Orientation": "6"})),
    "png_tiny_1x1": ImageClass("png", lambda: _save(textured(1, 1, seed=27), "PNG")),
    "png_tiny_3x2": ImageClass("png", lambda: _save(textured(3, 2, seed=28, alpha=True), "PNG")),
    "webp_lossy": ImageClass("webp", lambda: _save(textured(600, 400, seed=40), "WEBP", quality=90)),
    "webp_alpha": ImageClass("webp", lambda: _save(textured(600, 400, seed=41, alpha=True), "WEBP", quality=90)),
    "webp_lossless_alpha": ImageClass("webp", lambda: _save(textured(600, 400, seed=42, alpha=True), "WEBP",
                                                            lossless=True)),
}
"""Every class, by key. A key has no "." or "/" (webdataset splits member names at the first ".")."""


def write_corpus(out_dir: Path, classes: dict[str, ImageClass] = CLASSES) -> dict[str, bytes]:
    """Writes ``classes`` as img2dataset shards (NNNNN.tar, .parquet, _stats.json, one shard per
    format) into ``out_dir``; returns key -> the encoded image bytes written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {key: cls.make() for key, cls in classes.items()}
    for ext, shard in SHARD_OF_EXT.items():
        keys = [key for key, cls in classes.items() if cls.ext == ext]
        if not keys:
            continue
        rows = []
        with wds.TarWriter(str(out_dir / f"{shard:05d}.tar")) as writer:
            for key in keys:
                row = _manifest_row(key, written[key], classes[key])
                writer.write({"__key__": key, ext: written[key], "txt": row["caption"].encode(),
                              "json": json.dumps(row).encode()})
                rows.append(row)
        pq.write_table(pa.Table.from_pylist(rows, schema=PARQUET_SCHEMA), out_dir / f"{shard:05d}.parquet")
        (out_dir / f"{shard:05d}_stats.json").write_text(json.dumps(
            {"count": len(rows), "successes": len(rows), "failed_to_download": 0, "failed_to_resize": 0,
             "status_dict": {"success": len(rows)}}))
    return written


def _manifest_row(key: str, data: bytes, cls: ImageClass) -> dict:
    """img2dataset's row of a sample kept with its original bytes: sizes as stored."""
    with Image.open(io.BytesIO(data)) as img:
        width, height = img.size
    return {"url": f"https://img.example/{key}.{cls.ext}", "caption": f"a picture of class {key}", "key": key,
            "status": "success", "error_message": None, "width": width, "height": height,
            "original_width": width, "original_height": height, "exif": cls.exif,
            "sha256": hashlib.sha256(data).hexdigest()}
