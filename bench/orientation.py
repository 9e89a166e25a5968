"""What reading each image's header costs when a job is planned from img2dataset manifests, on
camera photos kept as their original bytes, against the work the same photos cost anyway.

    python bench/orientation.py [--photos 1200] [--rounds 3] [--quick] [--json FILE]

The corpus: img2dataset's keep-the-original-bytes layout (``--resize_mode no
--disable_all_reencoding True``): tars of camera-like JPEGs (1600x1200 or 1200x1600, quality 90,
a ~16 KiB EXIF segment with a random orientation 1-8) beside parquet files holding the stored
width/height. Arms, each planning the whole epoch in a fresh Job (process CPU per sample, the
reader thread included), interleaved for --rounds rounds after one warm-up round, best kept:
- ``manifest, headers read``: the default (``manifests="auto"``): keys and captions from the
  parquet, each image's header read by offset (size and EXIF orientation from the bytes);
- ``manifest, sizes only``: the same, with the header reads replaced by the parquet's stored sizes
  (what main did before the headers were read: it delivers rotated photos sideways; the baseline
  of the cost, not an option);
- ``tars``: ``manifests="off"``: every member read from the tar stream and parsed;
- ``decode``: decoding each photo to its planned size (media/imaging.decode_image), the work every
  sample costs once it is planned.
The cost of reading orientation is the first arm less the second, per sample, also as a share of
the decode. A restore re-plans one block (4,096 samples by default): the header reads add that
many times the per-sample cost.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import benchjson  # noqa: E402

SHARD_ROWS = 300
EXIF_PADDING = 16 << 10


def camera_jpeg(rng, portrait: bool, orientation: int) -> tuple[bytes, int, int]:
    """A textured photo-like JPEG with a camera-sized EXIF segment; (bytes, stored width, height)."""
    import numpy as np
    from PIL import Image

    width, height = (1200, 1600) if portrait else (1600, 1200)
    small = rng.integers(0, 255, (height // 40, width // 40, 3), dtype=np.uint8)
    image = Image.fromarray(small).resize((width, height), Image.BICUBIC)
    exif = Image.Exif()
    exif[0x0112] = orientation
    exif[0x010F], exif[0x0110] = "Camera", "Model 1"
    exif.get_ifd(0x8769)[0x927C] = bytes(EXIF_PADDING)  # the maker note of a camera, in its Exif IFD
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90, exif=exif.tobytes())
    return out.getvalue(), width, height


def write_corpus(folder: Path, photos: int, seed: int = 0) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import webdataset as wds

    rng = np.random.default_rng(seed)
    for shard in range((photos + SHARD_ROWS - 1) // SHARD_ROWS):
        rows = []
        with wds.TarWriter(str(folder / f"{shard:05d}.tar")) as writer:
            for i in range(shard * SHARD_ROWS, min(photos, (shard + 1) * SHARD_ROWS)):
                key, caption = f"{i:09d}", f"a photo number {i} " + "word " * int(rng.integers(3, 30))
                data, width, height = camera_jpeg(rng, bool(rng.random() < 0.3), int(rng.integers(1, 9)))
                writer.write({"__key__": key, "jpg": data, "txt": caption.encode(),
                              "json": json.dumps({"key": key, "caption": caption, "width": width,
                                                  "height": height}).encode()})
                rows.append({"key": key, "status": "success", "caption": caption, "width": width, "height": height,
                             "original_width": width, "original_height": height, "url": f"file:///{key}.jpg",
                             "error_message": None})
        pq.write_table(pa.Table.from_pylist(rows), folder / f"{shard:05d}.parquet")


def _config(folder: Path, manifests: str):
    from disttrain_api.config import JobConfig

    return JobConfig(shards=(str(folder),), seq_len=8192, dp_size=2, num_microbatches=4, manifests=manifests)


def plan_epoch(folder: Path, manifests: str) -> tuple[float, int]:
    """(process CPU seconds, documents) to plan the whole epoch in a fresh job."""
    from preprocess_service.adapters.io import shards
    from preprocess_service.service.job import Job

    shards._tar_index.cache_clear()  # each arm indexes the tars it reads by offset, as a fresh server does
    job = Job(_config(folder, manifests))
    start = time.process_time()
    steps = job.plan_all()
    seconds = time.process_time() - start
    return seconds, sum(len(list(job.step_plan(s).documents())) for s in range(steps))


def sizes_only():
    """ShardReader.iter_heads replaced by the parquet's sizes alone (no read): the baseline."""
    from preprocess_service.adapters.io import shards

    original = shards.ShardReader.iter_heads

    def no_reads(self, url, keys, on_problem, *, head_bytes, wanted, enough):
        for key in keys:
            yield key, {"jpg": shards.MemberHead(0, b"", b"")}

    return original, no_reads


def _fake_header_parse():
    """With no bytes read, the parse sees the manifest's size (as before headers were read)."""
    from preprocess_service.adapters.media import imaging, parse

    original = parse._image_ref

    def from_manifest(ext, data, config):
        if isinstance(data, parse.KnownImage) and not data.head:
            height, width = imaging.target_size(data.width, data.height, config)
            return parse.ImageRef(member=ext, height=height, width=width, orientation=1,
                                  tokens=imaging.num_image_tokens(height, width, config))
        return original(ext, data, config)

    return original, from_manifest


def plan_sizes_only(folder: Path) -> tuple[float, int]:
    from preprocess_service.adapters.io import shards
    from preprocess_service.adapters.media import parse

    heads, no_reads = sizes_only()
    image_ref, from_manifest = _fake_header_parse()
    shards.ShardReader.iter_heads, parse._image_ref = no_reads, from_manifest
    try:
        return plan_epoch(folder, "auto")
    finally:
        shards.ShardReader.iter_heads, parse._image_ref = heads, image_ref


def decode_all(folder: Path) -> tuple[float, int]:
    """CPU seconds to decode every photo to its planned size (headers read first, not timed)."""
    import tarfile

    from disttrain_api.config import ImageConfig
    from preprocess_service.adapters.media import imaging

    config, work = ImageConfig(), []
    for tar in sorted(folder.glob("*.tar")):
        with tarfile.open(tar) as f:
            for member in f:
                if member.name.endswith(".jpg"):
                    data = f.extractfile(member).read()
                    header = imaging.read_header(data)
                    work.append((data, imaging.target_size(header.width, header.height, config), header.orientation))
    start = time.process_time()
    for data, size_hw, orientation in work:
        imaging.decode_image(data, size_hw, orientation)
    return time.process_time() - start, len(work)


ARMS = {"manifest, headers read": lambda folder: plan_epoch(folder, "auto"),
        "manifest, sizes only": plan_sizes_only,
        "tars": lambda folder: plan_epoch(folder, "off"),
        "decode": decode_all}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--photos", type=int, default=1200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="40 photos, one round (a smoke test)")
    parser.add_argument("--json", help="write the results here (bench/benchjson.py)")
    args = parser.parse_args()
    photos, rounds = (40, 1) if args.quick else (args.photos, args.rounds)
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="orientation-") as tmp:
        folder = Path(tmp)
        write_corpus(folder, photos)
        for round_ in range(rounds + 1):  # the first round warms imports and the page cache: not kept
            for name, arm in ARMS.items():
                seconds, count = arm(folder)
                if round_ == 0:
                    continue
                assert count == photos, (name, count, photos)
                best[name] = min(best.get(name, float("inf")), seconds / count * 1e6)
    cost = best["manifest, headers read"] - best["manifest, sizes only"]
    rows = [[name, round(us, 1), round(us / best["decode"], 3)] for name, us in best.items()]
    rows.append(["headers read, less sizes only", round(cost, 1), round(cost / best["decode"], 3)])
    print(f"{photos} camera photos (1600x1200, ~16 KiB EXIF), best of {rounds} rounds, CPU us per sample")
    for name, us, share in rows:
        print(f"  {name:<34} {us:>9.1f} us   {share:>6.3f} x decode")
    doc = benchjson.document("orientation", quick=args.quick)
    doc["tables"].append(benchjson.table(
        f"planning from manifests: {photos} camera photos, best of {rounds} rounds",
        ["arm", "CPU us/sample", "x decode"], rows,
        notes=["headers read: the default; sizes only: the same without reading any byte (the manifest's "
               "stored sizes: every photo with an EXIF orientation other than 1 delivered turned or mirrored), "
               "the baseline of the cost",
               "a restore re-plans one block of shuffle_buffer samples: the header reads add that many "
               "times their per-sample cost"]))
    if args.json:
        benchjson.write(args.json, doc)


if __name__ == "__main__":
    main()
