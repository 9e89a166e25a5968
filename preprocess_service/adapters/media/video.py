"""Video: a container's header read to plan the frames, then the sampled frames decoded (PyAV, the
FFmpeg it bundles: H.264, HEVC, VP8/9, AV1 through dav1d, MPEG-4 ...; picked over torchcodec, which
needs a system FFmpeg, by bench/video.py).

Planning reads the header only (streams, size, duration, frame rate): VideoConfig's rule makes
``n`` frames (``fps`` a second, at most ``max_frames``, a multiple of ``temporal_patch``) at one
size (the image rule within ``max_pixels``), taken at evenly spaced times. Decoding goes through
the stream in order and keeps the first frame at or after each time, resized straight to the
planned size. Bounds, so a hostile file costs little: the header's frame size (max_source_pixels)
and duration (max_seconds); the frames and pixels one video may make the decoder produce
(max_decoded_frames, max_decoded_pixels: a million tiny frames or a huge size is refused when
planned, and stopped while decoding if the header lied); a video that ends before its last sampled
time (truncated) or yields no frame fails with that reason.
"""

from __future__ import annotations

import dataclasses
import io
import math
from dataclasses import dataclass

import numpy as np

from disttrain_api.config import ImageConfig, VideoConfig
from preprocess_service.adapters.media import imaging

VIDEO_EXTENSIONS = ("mp4", "webm", "mkv", "mov")
OPEN_OPTIONS = {"probesize": str(1 << 20), "analyzeduration": str(5_000_000)}
"""What FFmpeg may read to find the streams (bytes, microseconds): bounded, whatever the file says."""


@dataclass(frozen=True, slots=True)
class VideoHeader:
    width: int
    height: int
    seconds: float
    frames: int
    """Frames in the stream: the header's count, else its duration times its frame rate."""
    codec: str


@dataclass(frozen=True, slots=True)
class VideoPlan:
    frames: int
    height: int
    width: int
    tokens: int


def _open(data: bytes):
    import av

    return av.open(io.BytesIO(data), options=OPEN_OPTIONS)


def read_header(data: bytes) -> VideoHeader:
    """The first video stream's size, duration and frame count; ValueError when there is none."""
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
            return VideoHeader(int(context.width), int(context.height), seconds, frames, context.name)
    except av.FFmpegError as exc:
        raise ValueError(f"not a readable video ({type(exc).__name__}: {str(exc)[:200]})") from None


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
                last, last_frame = (float(frame.time) if frame.time is not None else last), frame
                if last + 1e-6 >= times[taken]:
                    array = _resized(frame, height, width)
                    while taken < frames and last + 1e-6 >= times[taken]:
                        out[taken] = array
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
        out[taken:] = _resized(last_frame, height, width)  # a stream whose last frame comes a little early
    return out


def _resized(frame, height: int, width: int) -> np.ndarray:
    return frame.reformat(width=width, height=height, format="rgb24", interpolation="AREA").to_ndarray()
