"""Video as a modality: videos encoded here with PyAV (H.264 in MP4, VP9 in WebM, AV1 in
Matroska) are planned from their headers by Qwen2-VL's rule, decoded to exactly the planned
frames, placed by <video> markers, and every bad or hostile video is skipped with its reason."""

import json

import numpy as np
import pytest
import webdataset as wds

from disttrain_api.config import ImageConfig, JobConfig, VideoConfig
from helpers import jpeg_bytes, video_bytes
from preprocess_service.adapters.decode import DecodePool, InlineDecoder
from preprocess_service.adapters.media import video
from preprocess_service.service.job import Job

CODECS = [("libx264", "mp4", "h264"), ("libvpx-vp9", "webm", "vp9"),
          ("libsvtav1", "matroska", "libdav1d")]  # AV1 is read by dav1d


@pytest.mark.parametrize("codec,container,name", CODECS)
def test_a_video_is_planned_from_its_header_and_decodes_to_the_frames_at_the_planned_times(codec, container, name):
    data = video_bytes(72, 160, 120, 24, codec=codec, container=container)  # 3 s
    header = video.read_header(data)
    assert (header.width, header.height, header.codec) == (160, 120, name)
    assert header.seconds == pytest.approx(3.0, abs=0.05)
    config = VideoConfig(fps=2.0, max_frames=32)
    planned = video.plan(header, ImageConfig(), config)
    assert planned.frames == 6 and (planned.height, planned.width) == (112, 168)  # multiples of 28
    assert planned.tokens == 6 // 2 * (112 // 28) * (168 // 28)
    frames = video.decode_video(data, (planned.frames, planned.height, planned.width, header.seconds, 10_000, 10**9))
    assert frames.shape == (6, 112, 168, 3) and frames.dtype == np.uint8
    # taken at 0.25, 0.75, ... 2.75 s: source frames 6, 18, ..., 66 (grey level 5 i)
    expected = [(round(t * 24) * 5) % 250 for t in video.sample_times(header.seconds, 6)]
    assert np.abs(frames.reshape(6, -1).mean(axis=1) - expected).max() < 4


def test_the_frame_count_follows_fps_max_frames_and_the_temporal_patch():
    short = video.read_header(video_bytes(6, 64, 64, 24))  # 0.25 s
    long = video.read_header(video_bytes(240, 64, 64, 24))  # 10 s
    rule = VideoConfig(fps=2.0, max_frames=8, temporal_patch=2)
    assert video.plan(short, ImageConfig(), rule).frames == 2  # one temporal patch: the frame repeated
    assert video.plan(long, ImageConfig(), rule).frames == 8  # capped by max_frames
    assert video.plan(long, ImageConfig(), VideoConfig(fps=0.5, max_frames=32, temporal_patch=4)).frames == 4
    data = video_bytes(6, 64, 64, 24)
    frames = video.decode_video(data, (2, 56, 56, short.seconds, 100, 10**8))
    assert frames.shape == (2, 56, 56, 3)


def _tar(path, samples):
    with wds.TarWriter(str(path)) as writer:
        for sample in samples:
            writer.write(sample)


def _skipped(job):
    return {s.key: (s.kind, s.reason) for s in job.report()["skipped"]}


def test_videos_in_a_job_are_placed_by_markers_decoded_and_bad_ones_skipped_with_their_reason(tmp_path):
    good = video_bytes(48, 160, 120, 24)  # 2 s
    cut = video_bytes(96, 160, 120, 24, codec="libvpx-vp9", container="webm")
    conversation = {"conversations": [{"from": "human", "value": "What happens in <video> and <image>?"},
                                      {"from": "gpt", "value": "A fade."}]}
    samples = [
        {"__key__": "plain", "mp4": good, "txt": b"a grey fade"},
        {"__key__": "chat", "mp4": good, "jpg": jpeg_bytes(96, 64), "json": json.dumps(conversation).encode()},
        {"__key__": "two", "mp4": good, "1.webm": video_bytes(24, 96, 64, 12, codec="libvpx-vp9", container="webm"),
         "txt": b"two clips"},
        {"__key__": "garbage", "mp4": b"\x00\x00\x00\x18ftypmp42" + b"\xff" * 500, "txt": b"not a video"},
        {"__key__": "truncated", "webm": cut[:len(cut) // 2], "txt": b"cut in half"},
        {"__key__": "empty", "mp4": video_bytes(0, 64, 64, 24), "txt": b"no frames"},
        {"__key__": "huge", "mp4": video_bytes(24, 320, 240, 24), "txt": b"frames too large"},
        {"__key__": "long", "mp4": video_bytes(100, 32, 32, 5), "txt": b"20 seconds"},
        {"__key__": "tiny-frames", "mp4": video_bytes(2400, 16, 16, 600), "txt": b"a flood of tiny frames"},
    ]
    _tar(tmp_path / "00000.tar", samples)
    config = JobConfig(shards=(str(tmp_path),), seq_len=2048, num_microbatches=2, shuffle_buffer=16,
                       video=VideoConfig(fps=2.0, max_frames=8, max_source_pixels=200 * 200, max_seconds=15,
                                         max_decoded_frames=2000))
    job = Job(config)
    steps = job.plan_all()
    skipped = _skipped(job)
    assert skipped["garbage"][0] == "unreadable_video"
    assert skipped["empty"][0] == "unreadable_video"
    assert skipped["huge"] == ("decompression_bomb", skipped["huge"][1]) and "max_source_pixels" in skipped["huge"][1]
    assert "max_seconds" in skipped["long"][1]
    assert "max_decoded_frames" in skipped["tiny-frames"][1]
    delivered = []
    pool = DecodePool(1)
    try:
        for step in range(steps):
            for index in range(job.step_plan(step).num_microbatches):
                mb = job.microbatch(job.step_plan(step), 0, index, pool)
                arrays = mb.arrays
                spans, video_shapes = arrays["video_spans"], arrays["video_shapes"]
                assert len(spans) == len(video_shapes)
                for (start, end), (frames, h, w, c) in zip(spans, video_shapes):
                    assert end - start == frames // 2 * (h // 28) * (w // 28) and c == 3
                    assert (arrays["modality"].reshape(-1)[start:end] == 5).all()
                assert arrays["video_pixels"].size == int(np.prod(video_shapes, axis=1).sum())
                delivered += mb.sample_keys
    finally:
        pool.close()
    skipped = _skipped(job)
    assert sorted(delivered) == ["chat", "plain", "two"]
    assert skipped["truncated"][0] == "decode_failed" and "truncated: its frames end at" in skipped["truncated"][1]
    assert set(delivered) | set(skipped) == {s["__key__"] for s in samples}


def test_a_conversation_places_its_video_where_the_marker_is():
    from preprocess_service.adapters.media.parse import parse_document
    from preprocess_service.core.sample import ImageRef, TextSegment, VideoRef
    from preprocess_service.core.tokenizer import ByteTokenizer

    conversation = {"conversations": [{"from": "human", "value": "<image> then <video>?"},
                                      {"from": "gpt", "value": "Yes."}]}
    doc = parse_document({"__key__": "k", "mp4": video_bytes(24, 64, 64, 24), "jpg": jpeg_bytes(64, 64),
                          "json": json.dumps(conversation).encode()},
                         image_config=ImageConfig(), tokenizer=ByteTokenizer(), seq_len=4096)
    kinds = [type(s).__name__ for s in doc.segments if not isinstance(s, TextSegment) or s.tokens]
    assert kinds.index("ImageRef") < kinds.index("VideoRef")
    text = [s for s in doc.segments if isinstance(s, TextSegment)]
    assert any(bytes(s.ids.astype(np.uint8)) == b" then " for s in text)
    assert isinstance(doc.segments[[type(s) for s in doc.segments].index(VideoRef)], VideoRef)
    assert sum(isinstance(s, ImageRef) for s in doc.segments) == 1


def test_a_header_that_understates_the_frames_is_stopped_while_decoding():
    data = video_bytes(240, 32, 32, 24)
    header = video.read_header(data)
    with pytest.raises(ValueError, match="header understates"):
        video.decode_video(data, (4, 28, 28, header.seconds, 100, 10**9))  # the bound the plan was given
    with pytest.raises(ValueError, match="header understates"):
        video.decode_video(data, (4, 28, 28, header.seconds, 10_000, 32 * 32 * 50))
    assert InlineDecoder  # the job test above runs the pool; the inline decoder shares decode_into


def test_a_video_dataset_resumes_mixes_with_images_and_is_inspected(tmp_path):
    from disttrain_api.config import DatasetConfig
    from disttrain_tools import inspect_cli
    from helpers import check_resumes, write_tiny_shards
    from preprocess_service.adapters.io.shards import ShardReader
    from preprocess_service.core.planner import Documents, EpochPlanner

    (tmp_path / "videos").mkdir()
    for shard in range(2):
        _tar(tmp_path / "videos" / f"{shard:05d}.tar",
             [{"__key__": f"v{shard}{i:02d}", "mp4": video_bytes(12 + 6 * i, 64, 48, 12), "txt": b"clip %d" % i}
              for i in range(8)])
    write_tiny_shards(tmp_path / "images", num_shards=1, samples_per_shard=8)
    config = JobConfig(shards=(str(tmp_path / "videos"),), seq_len=1024, num_microbatches=2, shuffle_buffer=4)
    job = Job(config)
    reader = ShardReader()

    def make():
        return EpochPlanner(config, reader.expand(config.shards), Documents(reader, job.documents.parse_only))

    def advance(planner):
        plan = planner.next_plan()
        return None if plan is None or plan.epoch else sorted(d.key for d in plan.documents())

    steps, _ = check_resumes(make, advance, at=lambda n: range(1, n))
    assert sorted(k for step in steps for k in step) == sorted(f"v{s}{i:02d}" for s in range(2) for i in range(8))

    mixed = Job(JobConfig(datasets=(DatasetConfig(name="video", shards=(str(tmp_path / "videos"),)),
                                    DatasetConfig(name="laion", shards=(str(tmp_path / "images"),))),
                          seq_len=1024, num_microbatches=2, shuffle_buffer=4, mix_epoch="all_exhausted"))
    mixed.plan_all()
    counts = {d["name"]: d["epoch_samples"] for d in mixed.report()["datasets"]}
    assert counts["video"] == 16 and counts["laion"] >= 8

    out = tmp_path / "inspect.json"
    assert inspect_cli.main([str(tmp_path / "videos"), "--json", str(out), "--no-plot", "--seq-len", "1024"]) == 0
    stats = json.loads(out.read_text())
    assert stats["modalities"]["video"] == 16 and stats["samples"]["skipped"] == 0
