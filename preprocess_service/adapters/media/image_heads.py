"""Whether the first bytes of an encoded image hold everything its header read needs.

Planning from a manifest reads only the first HEAD_BYTES of an image member by its offset, and
reads the whole member when they may not be enough, so the header read (imaging.read_header:
size, format, EXIF orientation) sees exactly what it would see in the whole file:
- JPEG: every marker segment up to the start of scan (SOS), where the frame size (SOF) and the
  EXIF orientation (APP1) are; an APP1 segment is at most 64 KiB, but ICC profiles and other
  segments before the scan can push SOS further;
- PNG: every chunk up to the first IDAT (IHDR and an eXIf chunk placed before the pixels; the
  header read never looks past them);
- anything else (WebP keeps its EXIF chunk after the pixels, GIF, TIFF ...): the whole file.
"""

from __future__ import annotations

HEAD_BYTES = 64 << 10
"""First bytes of an image member read at planning (a camera JPEG's EXIF segment fits)."""
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_JPEG_STANDALONE = {0x01, *range(0xD0, 0xD9)}
"""JPEG markers without a length field (TEM, RSTn, SOI)."""


def header_fits(head: bytes) -> bool:
    """True when ``head`` (an image's first bytes) holds all of its header (module docstring)."""
    if head[:3] == b"\xff\xd8\xff":
        return _jpeg_scan_starts_within(head)
    if head[:8] == _PNG_SIGNATURE:
        return _png_pixels_start_within(head)
    return False


def _jpeg_scan_starts_within(head: bytes) -> bool:
    pos = 2
    while pos + 4 <= len(head):
        if head[pos] != 0xFF:
            return False  # not a marker where one must be: let the header read see the whole file
        marker = head[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _JPEG_STANDALONE:
            pos += 2
            continue
        end = pos + 2 + int.from_bytes(head[pos + 2:pos + 4], "big")
        if marker == 0xDA:  # start of scan: the header read stops after this segment
            return end <= len(head)
        pos = end
    return False


def _png_pixels_start_within(head: bytes) -> bool:
    pos = len(_PNG_SIGNATURE)
    while pos + 8 <= len(head):
        if head[pos + 4:pos + 8] == b"IDAT":
            return True
        pos += 12 + int.from_bytes(head[pos:pos + 4], "big")  # length, type, data, CRC
    return False
