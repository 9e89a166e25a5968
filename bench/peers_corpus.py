"""The peers bench's second corpus: camera photos as users' LAION-style data holds them.

    python bench/peers_corpus.py [--out data/peers-camera] [--shards 3] [--per-shard 980]

img2dataset's "keep the original bytes" output (``--resize_mode no --disable_all_reencoding True``)
of camera photos: per shard ``NNNNN.tar`` (one ``.jpg`` and one ``.txt`` per sample, and img2dataset's
``.json``), ``NNNNN.parquet`` (img2dataset's own columns: the *stored* width and height, EXIF
tags) and ``NNNNN_stats.json``, so the service plans each shard from its parquet by default
(``manifests="auto"``). Each photo:

- 1-12 megapixels, log-uniform (a 1280x960 web-sized shot to a 4032x3024 phone original), the
  aspects of phone cameras (4:3 most, 16:9, 3:2), stored landscape as the sensor records it;
- EXIF as a camera writes it: orientation 1-8 (1 and 6, held upright, most), make, model and a
  maker note of 2-16 KiB in its Exif IFD;
- stored as the web serves JPEGs (disttrain_tools.synth.ENCODINGS["jpg"]): baseline most,
  progressive, greyscale, CMYK and Adobe YCCK;
- a picture with detail at full resolution (a smooth field plus per-pixel grain), so that its
  entropy decoding costs what a photo's does, not what a flat synthetic image's does.

Deterministic (a seed gives the same bytes); written once and reused while its marker matches.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import multiprocessing as mp
import os
import sys
import time
from concurrent import futures
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageChops

from disttrain_tools import synth  # the project's venv has it installed

REPO = Path(__file__).resolve().parent.parent

VERSION = 1
"""Bumped when the photos change: an old corpus on disk is then written again."""
DEFAULT_OUT = REPO / "data" / "peers-camera"
GRAIN_TILE = 509
"""Side of the per-pixel grain tile (prime: its repeats do not line up with JPEG's 8x8 blocks)."""


@dataclasses.dataclass(frozen=True)
class CameraCorpus:
    shards: int = 3
    per_shard: int = 980
    seed: int = 0
    megapixels: tuple[float, float] = (1.0, 12.0)


def _photo(config: CameraCorpus, shard: int, index: int) -> tuple[str, bytes, bytes, dict]:
    """(key, jpg, txt, img2dataset row) of photo ``index`` of ``shard``."""
    rng = np.random.default_rng([config.seed, shard, index, VERSION])
    key = f"{shard:05d}{index:04d}"
    caption = synth._draw_caption(rng)
    aspect = synth._pick(rng, synth._CAMERA_ASPECTS)
    lo, hi = np.log(config.megapixels[0] * 1e6), np.log(config.megapixels[1] * 1e6)
    pixels = float(np.exp(rng.uniform(lo, hi)))
    height = max(16, int(round((pixels / aspect) ** 0.5)))
    width = max(16, int(round(height * aspect)))
    orientation = synth._pick(rng, synth.CAMERA_ORIENTATIONS)
    exif, tags = synth._camera_exif(rng, orientation)
    tile = rng.integers(0, 25, (GRAIN_TILE, GRAIN_TILE, 3), dtype=np.uint8)
    grain = np.tile(tile, (-(-height // GRAIN_TILE), -(-width // GRAIN_TILE), 1))[:height, :width]
    image = ImageChops.add(synth._render(rng, width, height), Image.fromarray(np.ascontiguousarray(grain), "RGB"),
                           1.0, -12)  # field + grain - 12, clipped to 0-255
    encoding = synth._pick(rng, synth.ENCODINGS["jpg"])
    if encoding == "ycck":
        data = synth._ycck_jpeg(image, exif)
    else:
        mode = {"grey": "L", "cmyk": "CMYK"}.get(encoding, "RGB")
        data = synth._save(image.convert(mode), "JPEG", quality=synth.JPEG_QUALITY, exif=exif,
                           progressive=encoding == "progressive")
    row = {"url": f"https://example.invalid/photo/{key}.jpg", "caption": caption, "key": key, "status": "success",
           "error_message": None, "width": width, "height": height, "original_width": width,
           "original_height": height, "exif": json.dumps(tags), "sha256": hashlib.sha256(data).hexdigest()}
    return key, data, caption.encode("utf-8"), row


def _write_shard(args: tuple[Path, CameraCorpus, int]) -> tuple[int, int, float]:
    out, config, shard = args
    import webdataset as wds

    start = time.time()
    rows = []
    tar = out / f"{shard:05d}.tar"
    tmp = tar.with_name(tar.name + ".tmp")
    with open(tmp, "wb") as stream:
        writer = wds.TarWriter(stream, encoder=False, mtime=0)
        for index in range(config.per_shard):
            key, jpg, txt, row = _photo(config, shard, index)
            writer.write({"__key__": key, "jpg": jpg, "txt": txt,
                          "json": json.dumps(row, ensure_ascii=False).encode("utf-8")})
            rows.append(row)
        writer.close()
    tmp.replace(tar)
    pq.write_table(pa.Table.from_pylist(rows, schema=synth.IMG2DATASET_SCHEMA), out / f"{shard:05d}.parquet")
    end = time.time()
    n = len(rows)
    (out / f"{shard:05d}_stats.json").write_text(json.dumps(
        {"count": n, "successes": n, "failed_to_download": 0, "failed_to_resize": 0, "duration": round(end - start, 3),
         "start_time": start, "end_time": end, "status_dict": {"success": n}}, indent=4))
    return shard, tar.stat().st_size, end - start


def _marker(config: CameraCorpus) -> dict:
    """What corpus.json holds (as JSON reads it back: tuples are lists)."""
    return json.loads(json.dumps({"version": VERSION, "config": dataclasses.asdict(config)}))


def ensure(out: Path = DEFAULT_OUT, config: CameraCorpus = CameraCorpus(), log=print) -> list[str]:
    """The corpus's tar paths, written first unless ``out`` already holds it."""
    out = Path(out)
    marker = out / "corpus.json"
    tars = [out / f"{s:05d}.tar" for s in range(config.shards)]
    with synth.dataset_lock(out):
        try:
            found = json.loads(marker.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            found = None
        if found != _marker(config) or not all(t.is_file() for t in tars):
            out.mkdir(parents=True, exist_ok=True)
            marker.unlink(missing_ok=True)
            start = time.time()
            # forked: the children have this module as loaded (it may not be importable by name);
            # a child that dies breaks the pool (an error here), never hangs it
            workers = min(config.shards, len(os.sched_getaffinity(0)))
            with futures.ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as pool:
                for shard, size, took in pool.map(_write_shard, [(out, config, s) for s in range(config.shards)]):
                    log(f"peers corpus: shard {shard} of {config.per_shard} camera photos, {size / 1e6:.0f} MB "
                        f"in {took:.0f} s")
            marker.write_text(json.dumps(_marker(config), indent=2))
            log(f"peers corpus: {config.shards * config.per_shard} photos in {out} ({time.time() - start:.0f} s)")
    return [str(t) for t in tars]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--shards", type=int, default=CameraCorpus.shards)
    parser.add_argument("--per-shard", type=int, default=CameraCorpus.per_shard)
    parser.add_argument("--seed", type=int, default=CameraCorpus.seed)
    args = parser.parse_args(argv)
    for tar in ensure(args.out, CameraCorpus(args.shards, args.per_shard, args.seed)):
        print(tar)
    return 0


if __name__ == "__main__":
    sys.exit(main())
