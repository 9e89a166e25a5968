"""Video: a container's header read to plan the frames, then the sampled frames decoded (PyAV, the
FFmpeg it bundles: H.264, HEVC, VP8/9, AV1 through dav1d, MPEG-4 ...; picked over torchcodec, which
needs a system FFmpeg, by bench/video.py).

Planning reads the header (streams, size, duration, frame rate; the first frame for the orientation,
below): VideoConfig's rule makes ``n`` frames (``fps`` a second, at most ``max_frames``, a multiple
of ``temporal_patch``) at one size (the image rule within ``max_pixels``), taken at evenly spaced
times. Decoding goes through the stream in order and keeps the first frame at or after each time,
resized straight to the planned size. Bounds, so a hostile file costs little: the header's frame
size (max_source_pixels) and duration (max_seconds); the frames and pixels one video may make the
decoder produce (max_decoded_frames, max_decoded_pixels: a million tiny frames or a huge size is
refused when planned, and stopped while decoding if the header lied); a video that ends before its
last sampled time (truncated) or yields no frame fails with that reason.

Orientation: a phone stores its video as the sensor saw it and says how to show it, in a display
matrix (MP4/MOV's tkhd matrix, or a codec's display-orientation SEI: FFmpeg attaches it to the
decoded frames) or, in older files, a ``rotate`` tag (degrees clockwise). Frames are delivered as a
viewer shows them (FFmpeg's autorotate): the header reports the displayed size, and each decoded
frame is turned and mirrored. The transform is read from the first decoded frame (the header read
decodes it; the stream holds no other public copy in PyAV) and, failing a matrix, from the tag; the
decode reads it again the same way from the same first frame, so frames are turned as planned (the
delivered shape is the planned one in any case). An untrusted matrix is bounded: it is rounded to
the nearest of the eight quarter turns and mirrors (FFmpeg rotates by an arbitrary angle there; a
training frame stays axis-aligned), and one with a zero column (no angle: av_display_rotation_get's
NaN) or a tag that is not a finite number counts as none.
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from disttrain_api.config import ImageConfig, VideoConfig
from preprocess_service.adapters.media import imaging

VIDEO_EXTENSIONS = ("mp4", "webm", "mkv", "mov")
OPEN_OPTIONS = {"probesize": str(1 << 20), "analyzeduration": str(5_000_000)}
"""What FFmpeg may read to find the streams (bytes, microseconds): bounded, whatever the file says."""


ORIENTATIONS: dict[int, tuple[int, int, int, int]] = {
    1: (1, 0, 0, 1), 2: (-1, 0, 0, 1), 3: (-1, 0, 0, -1), 4: (1, 0, 0, -1),
    5: (0, 1, 1, 0), 6: (0, 1, -1, 0), 7: (0, -1, -1, 0), 8: (0, -1, 1, 0)}
"""EXIF orientation (imaging.py's convention: 6 = turn 90 degrees clockwise to show) -> the linear part
(m[0], m[1], m[3], m[4]) of the display matrix that means it: the matrix sends stored pixel (x, y),
y down, to (x m[0] + y m[3], x m[1] + y m[4]) (ISO 14496-12 tkhd, libavutil/display.h)."""
SWAPPING_ORIENTATIONS = frozenset({5, 6, 7, 8})
"""Orientations that swap width and height (quarter turns, transposes)."""


@dataclass(frozen=True, slots=True)
class VideoHeader:
    width: int
    """Displayed width, pixels (after the orientation)."""
    height: int
    seconds: float
    frames: int
    """Frames in the stream: the header's count, else its duration times its frame rate."""
    codec: str
    orientation: int = 1
    """EXIF orientation (1-8, 1 = as stored) that shows a stored frame as a viewer does."""


@dataclass(frozen=True, slots=True)
class VideoPlan:
    frames: int
    height: int
    width: int
    tokens: int


def _open(data: bytes):
    import av

    return av.open(io.BytesIO(data), options=OPEN_OPTIONS)


def read_header(data: bytes, *, max_pixels: int = VideoConfig.BOUNDS["max_source_pixels"][1]) -> VideoHeader:
    """The first video stream's displayed size, duration, frame count and orientation; ValueError
    when there is none. The orientation needs the first frame decoded, skipped for frames over
    ``max_pixels``, whose caller refuses them (width x height does not depend on it); the default,
    the largest video.max_source_pixels a job may set, reads it for every video a job accepts."""
    import av

    try:
        with _open(data) as container:
            if not container.streams.video:
                raise ValueError("holds no video stream")
            stream = container.streams.video[0]
            context = stream.codec_context
            seconds = float(stream.duration * stream.time_base) if stream.duration and stream.time_base else \
                (container.duration / av.time_base if container.duration else 0.0)
            rate = stream.average_rate or stream.guessed_rate
            frames = int(stream.frames) or (int(math.ceil(seconds * float(rate))) if rate else 0)
            width, height, name = int(context.width), int(context.height), context.name
            orientation = 1
            if width * height <= max_pixels:
                context.thread_count = 1  # frame threads would decode several frames before the first
                orientation = _orientation(stream, next(container.decode(stream), None))
    except av.FFmpegError as exc:
        raise ValueError(f"not a readable video ({type(exc).__name__}: {str(exc)[:200]})") from None
    if orientation in SWAPPING_ORIENTATIONS:
        width, height = height, width
    return VideoHeader(width, height, seconds, frames, name, orientation)


def orientation_of_matrix(matrix: Sequence[float]) -> int:
    """The EXIF orientation a display matrix (9 numbers, FFmpeg's layout) rounds to: of the eight
    in ORIENTATIONS, the one nearest its linear part with each column scaled to length 1 (as
    av_display_rotation_get scales it), the first on a tie; 1 when a column is zero or not finite."""
    m0, m1, m3, m4 = (float(matrix[i]) for i in (0, 1, 3, 4))
    scale0, scale1 = math.hypot(m0, m3), math.hypot(m1, m4)
    if not (0 < scale0 < math.inf and 0 < scale1 < math.inf):
        return 1
    unit = (m0 / scale0, m1 / scale1, m3 / scale0, m4 / scale1)
    return max(ORIENTATIONS, key=lambda o: sum(u * e for u, e in zip(unit, ORIENTATIONS[o])))


def orientation_of_rotate_tag(value: str) -> int:
    """The EXIF orientation of a legacy ``rotate`` tag (degrees clockwise), rounded to the nearest
    quarter turn; 1 when it is not a finite number."""
    try:
        degrees = float(value)
    except ValueError:
        return 1
    if not math.isfinite(degrees):
        return 1
    return (1, 6, 3, 8)[round(degrees / 90) % 4]


def _orientation(stream, frame) -> int:
    """The orientation of a stream whose first decoded frame is ``frame`` (None: it has none): its
    display matrix, else the stream's ``rotate`` tag, else 1."""
    side = frame.side_data.get("DISPLAYMATRIX") if frame is not None else None
    if side is not None:
        raw = bytes(side)
        if len(raw) == 36:  # 9 native int32, 16.16 fixed point (the last column 2.30)
            return orientation_of_matrix(np.frombuffer(raw, dtype=np.int32).tolist())
    tag = next((v for k, v in stream.metadata.items() if k.lower() == "rotate"), None)  # MKV writes ROTATE
    return orientation_of_rotate_tag(tag) if tag is not None else 1


def frame_config(image: ImageConfig, video: VideoConfig) -> ImageConfig:
    """The image rule a video's frames are sized by: the job's patches, video.max_pixels."""
    low = min(image.min_pixels, video.max_pixels)
    return dataclasses.replace(image, max_pixels=max(video.max_pixels, image.factor ** 2),
                               min_pixels=max(low, image.factor ** 2))


def plan(header: VideoHeader, image: ImageConfig, video: VideoConfig) -> VideoPlan:
    """Frames, their size and the tokens of a video; ValueError (its message the reason) when the
    header is out of bounds."""
    if header.width <= 0 or header.height <= 0:
        raise ValueError(f"its frames are {header.width}x{header.height}")
    if not math.isfinite(header.seconds) or header.seconds <= 0:
        raise ValueError("has no duration")
    if header.seconds > video.max_seconds:
        raise ValueError(f"is {header.seconds:.0f} s long, more than video.max_seconds {video.max_seconds:g}")
    if header.frames > video.max_decoded_frames:
        raise ValueError(f"has {header.frames} frames, more than video.max_decoded_frames {video.max_decoded_frames}")
    if header.frames * header.width * header.height > video.max_decoded_pixels:
        raise ValueError(f"would decode {header.frames} frames of {header.width}x{header.height}, more than "
                         f"video.max_decoded_pixels {video.max_decoded_pixels}")
    tp = video.temporal_patch
    wanted = min(video.max_frames, max(tp, int(header.seconds * video.fps)))
    frames = max(tp, wanted // tp * tp)
    config = frame_config(image, video)
    height, width = imaging.target_size(header.width, header.height, config)
    return VideoPlan(frames, height, width, frames // tp * imaging.num_image_tokens(height, width, config))


def sample_times(seconds: float, frames: int) -> list[float]:
    """The times the frames are taken at: the middles of ``frames`` equal parts of the video."""
    return [seconds * (i + 0.5) / frames for i in range(frames)]


def decode_video(data: bytes, params: tuple, out: np.ndarray | None = None) -> np.ndarray:
    """The planned frames, uint8 [frames, height, width, 3], into ``out`` when given. ``params``:
    (frames, height, width, seconds, max_decoded_frames, max_decoded_pixels)."""
    import av

    frames, height, width, seconds, max_frames, max_pixels = params
    if out is None:
        out = np.empty((frames, height, width, 3), dtype=np.uint8)
    times = sample_times(seconds, frames)
    taken = decoded = pixels = 0
    last, last_frame = 0.0, None
    orientation = 1
    try:
        with _open(data) as container:
            if not container.streams.video:
                raise ValueError("holds no video stream")
            stream = container.streams.video[0]
            stream.codec_context.thread_count = 1  # one decode process per core
            for frame in container.decode(stream):
                decoded += 1
                pixels += frame.width * frame.height
                if decoded > max_frames or pixels > max_pixels:
                    raise ValueError(f"decoding went past {decoded - 1} frames / {pixels} pixels "
                                     f"(video.max_decoded_frames {max_frames}, max_decoded_pixels {max_pixels}): "
                                     "its header understates it")
                if last_frame is None:  # the first frame, the one read_header took the orientation from
                    orientation = _orientation(stream, frame)
                last, last_frame = (float(frame.time) if frame.time is not None else last), frame
                if last + 1e-6 >= times[taken]:
                    _display_into(out[taken], frame, orientation)
                    taken += 1
                    while taken < frames and last + 1e-6 >= times[taken]:
                        out[taken] = out[taken - 1]
                        taken += 1
                if taken == frames:
                    break
    except av.FFmpegError as exc:
        if not decoded:
            raise ValueError(f"not a decodable video ({type(exc).__name__}: {str(exc)[:200]})") from None
    if last_frame is None:
        raise ValueError("yields no frame")
    if taken < frames:
        if seconds - last > seconds / frames:  # it ends more than one sampling interval early: the file is cut
            raise ValueError(f"truncated: its frames end at {last:.2f} s, its header says {seconds:.2f} s "
                             f"({taken} of {frames} frames)")
        _display_into(out[taken], last_frame, orientation)  # a stream whose last frame comes a little early
        out[taken + 1:] = out[taken]
    return out


def _display_into(dest: np.ndarray, frame, orientation: int) -> None:
    """Writes a decoded frame into ``dest`` (uint8 [height, width, 3]) as shown: resized as stored
    (to width x height when the orientation swaps them), then turned and mirrored by the copy into
    ``dest``, which moves each pixel as one 3-byte item (half the time of moving bytes)."""
    height, width = dest.shape[:2]
    if orientation in SWAPPING_ORIENTATIONS:
        height, width = width, height
    pixels = frame.reformat(width=width, height=height, format="rgb24", interpolation="AREA").to_ndarray()
    if orientation == 1:
        dest[...] = pixels
        return
    stored = pixels.view("V3")[..., 0]
    if orientation in (2, 4, 5, 7):  # the mirrored ones: flip left-right, then turn (imaging.py's order)
        stored = stored[:, ::-1]
    dest.view("V3")[..., 0] = np.rot90(stored, {3: 2, 4: 2, 5: 1, 6: 3, 7: 3, 8: 1}.get(orientation, 0))
