"""Shared test helpers: tiny datasets whose keys encode their own index, documents built by hand."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image

from preprocess_service.core.sample import Document, ImageRef, TextSegment

REPO = Path(__file__).resolve().parent.parent
"""The repository's root."""


def make_document(key: str, *, image_tokens: list[int] = (), text_tokens: int = 10) -> Document:
    images = tuple(ImageRef(member=f"{i}.jpg" if i else "jpg", height=28, width=28 * t, tokens=t)
                   for i, t in enumerate(image_tokens))
    text = TextSegment(member="txt", ids=np.arange(text_tokens, dtype=np.int32))
    return Document(key=key, shard="mem", segments=(*images, text))


def jpeg_bytes(width: int, height: int, *, seed: int = 0, quality: int = 90, exif_orientation: int | None = None,
               mode: str = "RGB", fmt: str = "JPEG") -> bytes:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 255, (6, 6, 3), dtype=np.uint8)).resize((width, height),
                                                                                 Image.Resampling.BILINEAR)
    if mode != "RGB":
        img = img.convert(mode)
    out = io.BytesIO()
    kwargs = {"quality": quality} if fmt == "JPEG" else {}
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        kwargs["exif"] = exif
    img.save(out, fmt, **kwargs)
    return out.getvalue()


def write_tiny_shards(out_dir: Path, *, num_shards: int = 2, samples_per_shard: int = 12, seed: int = 0,
                      extra: dict[str, dict] | None = None, compress: bool = False) -> list[Path]:
    """Shards with 9-digit keys f"{shard:05d}{index:04d}", one image (sometimes two) each, plus the
    parquet/stats side files img2dataset writes (whose content must never matter). ``extra`` maps
    a key to raw members added to shard 0. ``compress`` gzips each tar under the same name: a job
    re-reads a compressed shard by scanning it, so it holds its samples' encoded bytes from planning
    to decoding (a local plain tar's it reads again by pread: ShardReader.rereads_cheaply)."""
    rng = np.random.default_rng(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(num_shards):
        path = out_dir / f"{shard:05d}.tar"
        with wds.TarWriter(str(path)) as writer:
            for index in range(samples_per_shard):
                key = f"{shard:05d}{index:04d}"
                height = int(rng.integers(100, 700))
                width = int(height * rng.uniform(0.6, 1.8))
                sample = {"__key__": key, "jpg": jpeg_bytes(width, height, seed=shard * 1000 + index),
                          "txt": f"caption of sample {key} " .encode() * int(rng.integers(1, 6)),
                          "json": json.dumps({"key": key, "width": width, "height": height}).encode()}
                if index % 5 == 4:
                    sample["1.png"] = jpeg_bytes(200, 150, seed=index, fmt="PNG")
                writer.write(sample)
            if shard == 0:
                for key, members in (extra or {}).items():
                    writer.write({"__key__": key, **members})
        if compress:
            path.write_bytes(gzip.compress(path.read_bytes(), compresslevel=1))
        (out_dir / f"{shard:05d}.parquet").write_bytes(b"PAR1 not a tar PAR1")
        (out_dir / f"{shard:05d}_stats.json").write_text(json.dumps({"count": samples_per_shard}))
        paths.append(path)
    return paths


def shard_keys(paths: list[Path]) -> set[str]:
    """Every sample key in the tars, read independently of the service (tarfile)."""
    import tarfile

    keys = set()
    for path in paths:
        with tarfile.open(path) as tar:
            keys.update(name.split(".", 1)[0] for name in tar.getnames())
    return keys


def check_resumes(make, advance, *, at=None, load=None) -> tuple[list, list[dict]]:
    """The state round trip every stateful part must pass: ``make()`` builds a fresh one and
    ``advance(part)`` moves it one step, returning what that step produced (None: finished). The
    original runs to the end, its ``state_dict()`` taken (through JSON) before every step; then for
    each resume point k in ``at`` (steps, or a function of their number; default: the second, middle
    and last) a fresh part loads
    state k (``load(part, state)``, default ``part.load_state_dict(state)``) and must produce
    exactly the original's steps from k on. Returns (the steps, the states)."""
    part, steps, states = make(), [], []
    while True:
        states.append(json.loads(json.dumps(part.state_dict())))
        out = advance(part)
        if out is None:
            break
        steps.append(out)
    assert steps, "the part produced nothing to resume"
    n = len(steps)
    wanted = at(n) if callable(at) else at if at is not None else (1, n // 2, n - 1)
    points = sorted(set(wanted) & set(range(n)))
    for k in points:
        resumed = make()
        (load or (lambda p, s: p.load_state_dict(s)))(resumed, states[k])
        again = []
        while (out := advance(resumed)) is not None:
            again.append(out)
        assert again == steps[k:], f"resumed at step {k} of {len(steps)}: the steps differ from the original's"
    return steps, states


def install_plugins(root: Path, module: str, source: str, entry_points: dict[str, str]) -> Path:
    """Installs a plugin package into ``root`` as pip would (the module and its dist-info with
    ``disttrain.plugins`` entry points): put ``root`` on sys.path (or PYTHONPATH) and the service
    finds them. ``entry_points``: plugin name -> class name in ``module``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(source)
    dist = root / f"{module}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[disttrain.plugins]\n" + "".join(f"{name} = {module}:{cls}\n" for name, cls in entry_points.items()))
    return root


def video_bytes(num_frames: int = 48, width: int = 160, height: int = 120, fps: int = 24, *,
                codec: str = "libx264", container: str = "mp4", marked: bool = False,
                display_matrix: list[int] | None = None, tags: dict[str, str] | None = None) -> bytes:
    """A video encoded at test time (PyAV): frame i is a flat grey of level (i * 5) % 250, so a
    decoded frame tells which source frame it came from. ``marked``: the top-left (height / 4) x
    (width / 4) block of every frame is 128 levels off that grey, so a turned or mirrored frame
    shows it. ``display_matrix`` (FFmpeg's 9 int32, 16.16 fixed point; MP4 writes it as the tkhd
    matrix) and ``tags`` (stream metadata, e.g. a legacy ``rotate``) say how a viewer shows it."""
    import av

    out = io.BytesIO()
    with av.open(out, "w", format=container) as muxer:
        stream = muxer.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if display_matrix is not None:
            stream.set_display_matrix(display_matrix)
        stream.metadata.update(tags or {})
        for i in range(num_frames):
            frame = np.full((height, width, 3), (i * 5) % 250, dtype=np.uint8)
            if marked:
                frame[:height // 4, :width // 4] = ((i * 5) % 250 + 128) % 256
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                muxer.mux(packet)
        for packet in stream.encode():
            muxer.mux(packet)
    return out.getvalue()
