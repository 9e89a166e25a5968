"""Video decode rate per core, the decoder choice, and what a hostile video costs, in one run on
videos encoded here.

    python bench/video.py [--seconds 10] [--rounds 3] [--torchcodec DIR] [--quick] [--json FILE]

1. decode rate per core (one process, one decoder thread): for H.264 (MP4), VP9 (WebM) and AV1
   (Matroska, read by dav1d) at 640x360 and 1280x720, 30 fps: the service's decode of one video
   (media/video.decode_video: the job's default sampling, 2 fps up to 32 frames, resized to the
   frame size it plans) in videos/s and source frames decoded per second; beside it the floor, the
   same container decoded frame by frame with nothing kept (PyAV, no resize), and torchcodec's
   get_frames_played_at for the same times where torchcodec can run here (``--torchcodec DIR``: a
   folder it was pip-installed into with ``--target``; PyPI's wheel is the CUDA build, which needs
   CUDA's libraries to load).
2. bounds: seconds to refuse (plan) or fail (decode) each hostile video: garbage bytes, a video cut
   in half, zero frames, frames over max_source_pixels, a duration over max_seconds, and 6,000 tiny
   frames over max_decoded_frames. Each must be far below a second.
Arms run interleaved for --rounds rounds, best of each kept.
"""

from __future__ import annotations

import argparse
import functools
import io
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import benchjson  # noqa: E402

CODECS = (("h264", "libx264", "mp4"), ("vp9", "libvpx-vp9", "webm"), ("av1", "libsvtav1", "matroska"))


def encode(codec: str, container: str, seconds: float, width: int, height: int, fps: int = 30) -> bytes:
    """A moving test pattern (so inter-frame coding has work to do)."""
    import av
    import numpy as np

    out = io.BytesIO()
    y, x = np.mgrid[0:height, 0:width]
    with av.open(out, "w", format=container) as muxer:
        stream = muxer.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(int(seconds * fps)):
            frame = np.stack([(x + 3 * i) % 256, (y + 2 * i) % 256, ((x + y) // 2 + i) % 256], -1).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                muxer.mux(packet)
        for packet in stream.encode():
            muxer.mux(packet)
    return out.getvalue()


def floor_decode(data: bytes) -> int:
    """Every frame decoded, nothing kept: the least a decoder of this container must do."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = 1
        return sum(1 for _ in container.decode(stream))


def torchcodec_arm():
    """torchcodec's decode of the same times, or the reason it cannot run here."""
    try:
        from torchcodec.decoders import VideoDecoder
    except Exception as exc:  # not installed, or its native libraries do not load on this machine
        cause = exc.__cause__ or exc
        return None, f"cannot run here ({type(cause).__name__}: {str(cause)[:120]})"

    def decode(data: bytes, times: list[float]):
        return VideoDecoder(data, num_ffmpeg_threads=1).get_frames_played_at(times).data
    return decode, ""


def best(fn, rounds: int) -> float:
    out = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - started)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each test video")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 1 s videos, 360p only, 1 round; hostile videos cut short (2 s cut in "
                             "half, one 3840x2160 frame)")
    parser.add_argument("--torchcodec", type=Path, help="a folder torchcodec was pip-installed into (--target)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.torchcodec:
        sys.path.insert(0, str(args.torchcodec))
    if args.quick:
        args.seconds, args.rounds = 1.0, 1

    import os

    import torch

    from disttrain_api.config import ImageConfig, VideoConfig
    from preprocess_service.adapters.media import video

    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    torch.set_num_threads(1)
    config, image = VideoConfig(), ImageConfig()
    tc_decode, tc_reason = torchcodec_arm()
    rows = []
    sizes = [(640, 360)] if args.quick else [(640, 360), (1280, 720)]
    for name, codec, container in CODECS:
        for width, height in sizes:
            data = encode(codec, container, args.seconds, width, height)
            header = video.read_header(data)
            planned = video.plan(header, image, config)
            params = (planned.frames, planned.height, planned.width, header.seconds,
                      config.max_decoded_frames, config.max_decoded_pixels)
            times = video.sample_times(header.seconds, planned.frames)
            ours = best(functools.partial(video.decode_video, data, params), args.rounds)
            floor = best(functools.partial(floor_decode, data), args.rounds)
            theirs = best(functools.partial(tc_decode, data, times), args.rounds) if tc_decode else None
            rows.append([name, f"{width}x{height}", header.frames, planned.frames,
                         f"{planned.height}x{planned.width}", round(1 / ours, 2), round(header.frames / ours),
                         round(header.frames / floor), round(floor / ours, 2),
                         round(1 / theirs, 2) if theirs else "-"])
    rule = VideoConfig(max_source_pixels=1280 * 720, max_seconds=60, max_decoded_frames=2000)
    # --quick: shorter hostile videos where the length is not what is refused (encoding them was
    # most of a quick run: six 3840x2160 frames alone took 4.5 s)
    cut_s, big_s = (2, 1 / 30) if args.quick else (4, 0.2)
    hostile = {"garbage bytes": b"\x00\x00\x00\x18ftypmp42" + os.urandom(4096),
               "cut in half": (lambda d: d[:len(d) // 2])(encode("libvpx-vp9", "webm", cut_s, 320, 240)),
               "zero frames": encode("libx264", "mp4", 0, 64, 64),
               "3840x2160 frames": encode("libx264", "mp4", big_s, 3840, 2160),
               "61 s long": encode("libx264", "mp4", 61, 16, 16, fps=2),
               "6,000 tiny frames": encode("libx264", "mp4", 10, 16, 16, fps=600)}
    bounds = []
    for label, data in hostile.items():
        started = time.perf_counter()
        try:
            header = video.read_header(data)
            if header.width * header.height > rule.max_source_pixels:
                raise ValueError(f"frames of {header.width}x{header.height} exceed max_source_pixels")
            planned = video.plan(header, image, rule)
            video.decode_video(data, (planned.frames, planned.height, planned.width, header.seconds,
                                      rule.max_decoded_frames, rule.max_decoded_pixels))
            outcome, reason = "decoded (not refused!)", ""
        except ValueError as exc:
            outcome, reason = "refused", str(exc)[:90]
        bounds.append([label, len(data), outcome, round((time.perf_counter() - started) * 1000, 1), reason])

    doc = benchjson.document("video", quick=args.quick)
    doc["tables"].append(benchjson.table(
        f"decode rate per core ({args.seconds:g} s videos at 30 fps; 2 fps up to 32 frames sampled)",
        ["codec", "source", "frames", "sampled", "to", "videos/s", "frames/s decoded", "floor frames/s",
         "x of floor", "torchcodec videos/s"], rows,
        notes=["floor: the same container decoded frame by frame with nothing kept, PyAV, one thread",
               f"torchcodec: {tc_reason or 'its get_frames_played_at for the same times, one FFmpeg thread'}"]))
    doc["tables"].append(benchjson.table(
        "hostile videos: refused while planning or decoding", ["video", "bytes", "outcome", "ms", "reason"], bounds))
    for table in doc["tables"]:
        print(table["title"])
        print("  " + " | ".join(table["columns"]))
        for row in table["rows"]:
            print("  " + " | ".join(str(c) for c in row))
        for note in table["notes"]:
            print("  note: " + note)
    benchjson.write(args.json, doc)
    return 0 if all(row[2] == "refused" for row in bounds) else 1


if __name__ == "__main__":
    raise SystemExit(main())
