"""Phone videos carry a display rotation (a display matrix: MP4's tkhd; or a legacy ``rotate``
tag); the service must deliver their frames as a viewer shows them, sized from the displayed shape.

The oracle shares no code with the service: it decodes the same bytes with PyAV, places every
stored pixel where the display matrix the test wrote sends it (the matrix's own meaning, no table
of rotations), resizes with Pillow, and matches each delivered frame to the nearest reference frame.
"""

import io
import json

import numpy as np
import pytest
from PIL import Image

from disttrain_api.config import ImageConfig, VideoConfig
from helpers import video_bytes
from preprocess_service.adapters.decode.items import decode_item
from preprocess_service.adapters.media import video
from preprocess_service.core.modalities import MODALITIES

ONE = 1 << 16  # 1.0 in the display matrix's 16.16 fixed point
W = 1 << 30  # its last column is 2.30


def _matrix(a: int, b: int, c: int, d: int) -> list[int]:
    """Sends stored pixel (x, y), y down, to (a x + c y, b x + d y) (ISO 14496-12 tkhd)."""
    return [a * ONE, b * ONE, 0, c * ONE, d * ONE, 0, 0, 0, W]


MATRICES = {  # name -> (matrix, the displayed frame is portrait for a landscape stored one)
    "none": (None, False),
    "rotate-90": (_matrix(0, 1, -1, 0), True),  # an iPhone held upright: turn 90 degrees clockwise
    "rotate-180": (_matrix(-1, 0, 0, -1), False),
    "rotate-270": (_matrix(0, -1, 1, 0), True),
    "hflip": (_matrix(-1, 0, 0, 1), False),
    "vflip": (_matrix(1, 0, 0, -1), False),
    "hflip-rotate-90": (_matrix(0, 1, 1, 0), True),  # a mirror across the main diagonal
    "hflip-rotate-270": (_matrix(0, -1, -1, 0), True),  # across the other one
}
TOLERANCE = 3
"""Grey levels a delivered pixel may differ from the oracle's: both decode the same bitstream, so
only the resizers (FFmpeg's area filter, Pillow's box filter) differ."""
FPS, STORED_W, STORED_H = 12, 448, 224
RULE = VideoConfig(fps=4.0, max_frames=8, max_pixels=112 * 224)
"""A 448 x 224 frame is resized by exactly 1/2 (224 x 112 or 112 x 224), on the block's edges."""


def _shown(stored: np.ndarray, matrix: list[int] | None) -> np.ndarray:
    """``stored`` as the display matrix shows it: every pixel centre sent where the matrix says, the
    result moved to start at the origin."""
    if matrix is None:
        return stored
    h, w = stored.shape[:2]
    a, b, c, d = (matrix[i] / ONE for i in (0, 1, 3, 4))
    ys, xs = np.mgrid[0:h, 0:w] + 0.5
    xd, yd = xs * a + ys * c, xs * b + ys * d
    xd, yd = np.floor(xd - xd.min()).astype(int), np.floor(yd - yd.min()).astype(int)
    out = np.zeros((yd.max() + 1, xd.max() + 1, 3), dtype=np.uint8)
    out[yd, xd] = stored
    assert out.size == stored.size, "the matrix is not a quarter turn or a mirror"
    return out


def _reference(data: bytes, matrix: list[int] | None, height: int, width: int) -> tuple[list[float], np.ndarray]:
    """Every frame of ``data`` (its time, and the frame shown and resized to height x width),
    decoded here; checks the file carries the matrix the test wrote."""
    import av

    times, frames = [], []
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(container.streams.video[0]):
            side = frame.side_data.get("DISPLAYMATRIX")
            assert (np.frombuffer(bytes(side), dtype=np.int32).tolist() if side is not None else None) == matrix
            shown = _shown(frame.to_ndarray(format="rgb24"), matrix)
            frames.append(np.asarray(Image.fromarray(shown).resize((width, height), Image.Resampling.BOX)))
            times.append(float(frame.time))
    return times, np.stack(frames)


def _check_against_oracle(data: bytes, delivered: np.ndarray, seconds: float, matrix) -> int:
    """Each delivered frame is the reference frame its sampling time names (the first at or after
    it), within TOLERANCE; returns the largest deviation."""
    times, reference = _reference(data, matrix, *delivered.shape[1:3])
    worst = 0
    for k, t in enumerate(video.sample_times(seconds, len(delivered))):
        errors = np.abs(reference.astype(np.int16) - delivered[k].astype(np.int16))
        nearest = int(errors.reshape(len(reference), -1).mean(axis=1).argmin())
        wanted = next(i for i, s in enumerate(times) if s + 1e-6 >= t)
        assert nearest == wanted, f"frame {k} (at {t:.3f} s) looks like source frame {nearest}, not {wanted}"
        worst = max(worst, int(errors[wanted].max()))
    assert worst <= TOLERANCE, f"a delivered pixel is {worst} grey levels off the oracle's"
    return worst


@pytest.mark.parametrize("name", list(MATRICES))
def test_a_rotated_or_mirrored_video_is_delivered_as_a_viewer_shows_it(name):
    matrix, portrait = MATRICES[name]
    data = video_bytes(24, STORED_W, STORED_H, FPS, marked=True, display_matrix=matrix)  # 2 s
    header = video.read_header(data)
    assert (header.width, header.height) == ((STORED_H, STORED_W) if portrait else (STORED_W, STORED_H))
    planned = video.plan(header, ImageConfig(), RULE)
    assert (planned.height, planned.width) == ((224, 112) if portrait else (112, 224))
    frames = video.decode_video(data, (planned.frames, planned.height, planned.width, header.seconds, 10_000, 10**9))
    assert frames.shape == (8, planned.height, planned.width, 3)
    _check_against_oracle(data, frames, header.seconds, matrix)


def test_unresized_frames_match_the_oracle_exactly_for_a_quarter_turn():
    matrix = MATRICES["rotate-90"][0]
    data = video_bytes(12, 224, 112, FPS, marked=True, display_matrix=matrix)  # multiples of 28: no resize
    header = video.read_header(data)
    planned = video.plan(header, ImageConfig(), VideoConfig(fps=4.0, max_frames=4))
    assert (planned.height, planned.width) == (224, 112)
    frames = video.decode_video(data, (planned.frames, 224, 112, header.seconds, 10_000, 10**9))
    assert _check_against_oracle(data, frames, header.seconds, matrix) <= 1


def test_a_legacy_rotate_tag_turns_the_frames_when_there_is_no_matrix():
    data = video_bytes(24, STORED_W, STORED_H, FPS, container="matroska", marked=True, tags={"rotate": "90"})
    header = video.read_header(data)
    assert (header.width, header.height, header.orientation) == (STORED_H, STORED_W, 6)
    planned = video.plan(header, ImageConfig(), RULE)
    frames = video.decode_video(data, (planned.frames, planned.height, planned.width, header.seconds, 10_000, 10**9))
    times, reference = _reference(data, None, STORED_H // 2, STORED_W // 2)  # the stored frames, unturned
    turned = np.stack([_shown(f, MATRICES["rotate-90"][0]) for f in reference])
    wanted = [next(i for i, s in enumerate(times) if s + 1e-6 >= t) for t in video.sample_times(header.seconds, 8)]
    assert np.abs(turned[wanted].astype(np.int16) - frames).max() <= TOLERANCE


def test_a_header_over_the_caller_s_pixel_bound_is_read_without_decoding_a_frame():
    data = video_bytes(6, STORED_W, STORED_H, FPS, display_matrix=MATRICES["rotate-90"][0])
    assert video.read_header(data).orientation == 6
    header = video.read_header(data, max_pixels=STORED_W * STORED_H - 1)  # refused by the caller, orientation unread
    assert (header.width, header.height, header.orientation) == (STORED_W, STORED_H, 1)


@pytest.mark.parametrize("matrix,orientation", [
    ([0] * 9, 1),  # no angle: av_display_rotation_get is NaN
    ([ONE, 0, 0, 0, 0, 0, 0, 0, W], 1),  # one column zero
    ([-(2**31), 2**31 - 1, 7, 2**31 - 1, -(2**31), 3, 5, 5, 0], 3),  # extreme values: nearest is 180 degrees
    ([56756, 32768, 0, -32768, 56756, 0, 0, 0, W], 1),  # 30 degrees: rounds to no turn
    ([32768, 56756, 0, -56756, 32768, 0, 0, 0, W], 6),  # 60 degrees clockwise: rounds to a quarter turn
    ([2 * ONE, 0, 0, 0, -ONE // 3, 0, 0, 0, W], 4),  # scaled columns: still a vertical mirror
    (_matrix(0, 1, -1, 0), 6), (_matrix(0, -1, 1, 0), 8), (_matrix(0, 1, 1, 0), 5), (_matrix(0, -1, -1, 0), 7),
])
def test_a_display_matrix_rounds_to_a_quarter_turn_or_mirror_and_garbage_counts_as_none(matrix, orientation):
    assert video.orientation_of_matrix(matrix) == orientation


@pytest.mark.parametrize("tag,orientation", [("90", 6), ("180", 3), ("270", 8), ("-90", 8), ("450", 6), ("89.4", 6),
                                             ("0", 1), ("nan", 1), ("inf", 1), ("1e400", 1), ("ninety", 1), ("", 1)])
def test_a_rotate_tag_rounds_to_a_quarter_turn_and_garbage_counts_as_none(tag, orientation):
    assert video.orientation_of_rotate_tag(tag) == orientation


def test_a_rotated_video_s_document_is_planned_at_its_displayed_shape_and_decodes_to_it():
    from preprocess_service.adapters.media.parse import parse_document
    from preprocess_service.core.sample import VideoRef
    from preprocess_service.core.tokenizer import ByteTokenizer

    data = video_bytes(24, STORED_W, STORED_H, FPS, marked=True, display_matrix=MATRICES["rotate-90"][0])
    conversation = {"conversations": [{"from": "human", "value": "<video> what is this?"},
                                      {"from": "gpt", "value": "A phone clip."}]}
    doc = parse_document({"__key__": "k", "mp4": data, "json": json.dumps(conversation).encode()},
                         image_config=ImageConfig(), tokenizer=ByteTokenizer(), seq_len=8192, video_config=RULE)
    ref = next(s for s in doc.segments if isinstance(s, VideoRef))
    assert (ref.height, ref.width) == (224, 112)  # portrait, as shown
    assert ref.tokens == ref.frames // RULE.temporal_patch * (224 // 28) * (112 // 28)
    shape, params = MODALITIES["video"].slot(ref, None)
    frames = decode_item("video", data, params, np.empty(shape, dtype=np.uint8))
    assert frames.shape == shape == (ref.frames, 224, 112, 3)
    _check_against_oracle(data, frames, ref.seconds, MATRICES["rotate-90"][0])
