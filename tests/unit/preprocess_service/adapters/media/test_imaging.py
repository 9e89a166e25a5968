import io

import numpy as np
import pytest
from PIL import Image, ImageOps

from disttrain_api.config import ImageConfig
from helpers import jpeg_bytes
from preprocess_service.adapters.media import imaging

CFG = ImageConfig()


@pytest.mark.parametrize("w,h", [(150, 150), (640, 480), (3000, 2000), (300, 2900), (20, 5000), (50, 40)])
def test_target_size_multiple_of_token_edge_within_pixel_bounds_aspect_kept(w, h):
    th, tw = imaging.target_size(w, h, CFG)
    assert th % 28 == 0 and tw % 28 == 0
    assert CFG.min_pixels <= th * tw <= CFG.max_pixels
    if min(w, h) >= 150 and max(w, h) / min(w, h) < 10:
        assert abs((tw / th) / (w / h) - 1) < 0.15
    assert imaging.num_image_tokens(th, tw, CFG) == th * tw // 784


def test_draft_decode_matches_a_full_decode_closely_and_has_exact_size():
    data = jpeg_bytes(2400, 1600, seed=1)
    th, tw = imaging.target_size(2400, 1600, CFG)
    fast = imaging.decode_image(data, (th, tw))
    assert fast.shape == (th, tw, 3) and fast.dtype == np.uint8
    full = np.asarray(Image.open(io.BytesIO(data)).convert("RGB").resize((tw, th), Image.Resampling.BICUBIC))
    assert np.abs(fast.astype(int) - full.astype(int)).mean() < 4.0


def test_exif_orientation_is_applied_and_header_reports_displayed_size():
    data = jpeg_bytes(400, 200, seed=2, exif_orientation=6)  # stored landscape, shown portrait
    header = imaging.read_header(data)
    assert (header.width, header.height) == (200, 400)
    th, tw = imaging.target_size(header.width, header.height, CFG)
    out = imaging.decode_image(data, (th, tw))
    assert out.shape == (th, tw, 3) and th > tw
    expected = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
                          .resize((tw, th), Image.Resampling.BICUBIC))
    assert np.abs(out.astype(int) - expected.astype(int)).mean() < 4.0


@pytest.mark.parametrize("mode,fmt", [("L", "JPEG"), ("CMYK", "JPEG"), ("RGBA", "PNG"), ("P", "PNG"),
                                      ("L", "PNG"), ("RGB", "WEBP"), ("I;16", "PNG")])
def test_non_rgb_modes_and_formats_come_out_rgb_uint8(mode, fmt):
    data = jpeg_bytes(300, 200, seed=3, mode=mode, fmt=fmt)
    out = imaging.decode_image(data, (196, 308))
    assert out.shape == (196, 308, 3) and out.dtype == np.uint8


def test_transparent_pixels_become_white():
    img = Image.new("RGBA", (56, 56), (255, 0, 0, 0))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    out = imaging.decode_image(buf.getvalue(), (56, 56))
    assert (out == 255).all()


def test_garbage_and_truncation_are_detected_from_the_header():
    with pytest.raises(ValueError, match="not a readable image"):
        imaging.read_header(b"\x00\x01random bytes" * 10)
    data = jpeg_bytes(300, 300)
    assert not imaging.looks_truncated(data, "JPEG")
    assert imaging.looks_truncated(data[: len(data) // 2], "JPEG")


@pytest.mark.parametrize("width, height, orientation, size_hw", [
    (640, 480, None, (224, 308)),   # downscaled (JPEG DCT scale, then resized)
    (300, 200, 6, (196, 308)),      # rotated by its EXIF orientation, then upscaled
    (224, 168, None, (168, 224)),   # already the target size: no resize, copied in
])
def test_decoding_into_a_slot_writes_exactly_what_decoding_returns(width, height, orientation, size_hw):
    """Decode workers resize straight into the microbatch's shared memory (``out``): the pixels must
    be those decode_image returns, the slot must be the array returned, and nothing around it written."""
    data = jpeg_bytes(width, height, seed=width, exif_orientation=orientation)
    expected = imaging.decode_image(data, size_hw)
    h, w = size_hw
    memory = np.full(h * w * 3 + 64, 7, dtype=np.uint8)
    slot = np.ndarray((h, w, 3), dtype=np.uint8, buffer=memory, offset=32)
    assert imaging.decode_image(data, size_hw, out=slot) is slot
    np.testing.assert_array_equal(slot, expected)
    assert (memory[:32] == 7).all() and (memory[32 + h * w * 3:] == 7).all()
    square = imaging.decode_square(data, 112)
    out = np.zeros_like(square)
    assert imaging.decode_square(data, 112, out=out) is out
    np.testing.assert_array_equal(out, square)


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("width, height", [(1, 1), (1, 40), (40, 1)])
def test_one_pixel_wide_or_high_images_decode_in_every_orientation(width, height, orientation):
    """A one-pixel-wide view keeps its negative stride through np.ascontiguousarray (torch refused it)."""
    data = jpeg_bytes(width, height, seed=3, exif_orientation=orientation)
    header = imaging.read_header(data)
    size_hw = imaging.target_size(header.width, header.height, ImageConfig())
    out = imaging.decode_image(data, size_hw, header.orientation)
    assert out.shape == (*size_hw, 3) and out.dtype == np.uint8
    assert imaging.decode_square(data, 64, header.orientation).shape == (64, 64, 3)
