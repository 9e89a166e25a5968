"""Shuffle quality at equal memory: ours against webdataset and MosaicML Streaming.

    .venv/bin/python bench/shuffle.py [--shards 64] [--per-shard 500] [--buffer 4096] [--batch 256]
                                      [--quick] [--json FILE]

The dataset is the worst case for a streaming shuffle: --shards tars written here whose samples
are sorted by a label (16 "sources", shard i holding source i * 16 // shards only, and caption
length growing with the sample's index). Each system reads one epoch of it; printed, per system:

- |Spearman rank correlation| between the order samples are read in and their order in the
  dataset (0: no trace of the source order; 1: the source order);
- distinct shards and distinct labels in a global batch of --batch consecutive samples (mean over
  the epoch's batches; a perfect shuffle nears min(batch, shards) and 16);
- CPU per sample (process time of the whole read, each system's own pipeline over the same tars)
  and the most file handles the process held open while reading.

Systems, at equal memory (--buffer samples held for shuffling):
- ours: the service's planner (JobConfig shuffle_buffer = --buffer, open_shards at its default,
  16; it also parses, packs and plans steps, so its CPU counts more work than a shuffle);
- ours-1: the same with open_shards 1 (one shard after another: the block shuffle alone);
- webdataset: ``WebDataset(urls, shardshuffle=len(urls), seed=...)`` + ``.shuffle(--buffer)``
  (every shard shuffled, then its sample buffer);
- mosaicml-py1e: MosaicML Streaming's py1e sample order (``get_shuffle_py1e`` with
  shuffle_block_size --buffer, one canonical node), loaded from the mosaicml-streaming 0.11.0
  wheel (its shuffle module needs numpy only; the wheel is fetched with ``pip download`` once);
  an order, not a reader: CPU and handles are those of computing the order. Skipped, with a note,
  where the wheel cannot be had;
- sequential: no shuffle (the floor of quality).

A second table sweeps ours over open_shards x shuffle_buffer (the defaults, 16 and 4096, were chosen
from it: quality against the memory a block holds and the shards open at once).

``--quick`` is a smoke run (8 shards of 200 samples, a 1024-sample buffer), not a measurement.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import webdataset as wds

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import benchjson  # noqa: E402

from disttrain_api.config import JobConfig  # noqa: E402
from preprocess_service.service.job import Job  # noqa: E402

LABELS = 16
MOSAIC_WHEEL = "mosaicml_streaming-0.11.0-py3-none-any.whl"
WHEEL_DIR = REPO / ".venv-peers" / "wheels"


def write_sorted(root: Path, shards: int, per_shard: int) -> list[str]:
    urls = []
    for s in range(shards):
        path = root / f"{s:05d}.tar"
        with wds.TarWriter(str(path)) as writer:
            for i in range(per_shard):
                index = s * per_shard + i
                label = s * LABELS // shards
                text = f"source {label:02d} " + "x" * (8 + index * 200 // (shards * per_shard))
                writer.write({"__key__": f"{index:08d}", "txt": text.encode()})
        urls.append(str(path))
    return urls


def open_handles() -> int:
    return len(os.listdir("/proc/self/fd"))


def quality(order: list[int], shards: int, per_shard: int, batch: int) -> tuple[float, float, float]:
    """(|Spearman rho| between read position and source index, mean distinct shards and labels per batch)."""
    ids = np.asarray(order, dtype=np.int64)
    n = len(ids)
    ranks = np.empty(n)
    ranks[np.argsort(ids, kind="stable")] = np.arange(n)
    position = np.arange(n, dtype=float)
    rho = float(np.corrcoef(position, ranks)[0, 1])
    shard_of = ids // per_shard
    label_of = shard_of * LABELS // shards
    full = n // batch * batch
    distinct_shards = np.mean([len(np.unique(shard_of[i:i + batch])) for i in range(0, full, batch)])
    distinct_labels = np.mean([len(np.unique(label_of[i:i + batch])) for i in range(0, full, batch)])
    return abs(rho), float(distinct_shards), float(distinct_labels)


def read_ours(urls: list[str], buffer: int, open_shards: int) -> tuple[list[int], float, int]:
    config = JobConfig(shards=tuple(urls), seq_len=4096, dp_size=2, num_microbatches=4, shuffle_buffer=buffer,
                       open_shards=open_shards, reorder_algorithm="arrival", seed=1)
    job = Job(config)
    began, handles, order = time.process_time(), open_handles(), []
    planner = job.plans.planner
    while (plan := planner.next_plan()) is not None:
        order.extend(int(doc.key) for seq in plan.sequences for doc in seq.documents)
        handles = max(handles, open_handles())
    return order, time.process_time() - began, handles


def read_webdataset(urls: list[str], buffer: int) -> tuple[list[int], float, int]:
    began, handles, order = time.process_time(), open_handles(), []
    dataset = wds.WebDataset(urls, shardshuffle=len(urls), seed=1, empty_check=False).shuffle(buffer)
    for sample in dataset:
        order.append(int(sample["__key__"]))
        if len(order) % 256 == 0:
            handles = max(handles, open_handles())
    return order, time.process_time() - began, handles


def py1e():
    """MosaicML Streaming's get_shuffle_py1e, from its installed package or its wheel; None if neither."""
    try:
        from streaming.base.shuffle.py1e import get_shuffle_py1e  # type: ignore[import-not-found]

        return get_shuffle_py1e, "installed"
    except ImportError:
        pass
    wheel = WHEEL_DIR / MOSAIC_WHEEL
    if not wheel.exists():
        WHEEL_DIR.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(WHEEL_DIR),
                        "mosaicml-streaming==0.11.0"], capture_output=True, timeout=120)
    if not wheel.exists():
        return None, "the mosaicml-streaming wheel could not be downloaded"
    out = Path(tempfile.mkdtemp(prefix="mosaic-"))
    with zipfile.ZipFile(wheel) as z:
        for name in ("py1s.py", "py1e.py"):
            source = z.read(f"streaming/base/shuffle/{name}").decode()
            (out / name).write_text(source.replace("from streaming.base.shuffle.py1s import", "from py1s import"))
    sys.path.insert(0, str(out))
    spec = importlib.util.spec_from_file_location("py1e", out / "py1e.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_shuffle_py1e, f"from {MOSAIC_WHEEL}"


def read_mosaic(get, shards: int, per_shard: int, buffer: int) -> tuple[list[int], float, int]:
    began = time.process_time()
    ids = get(np.full(shards, per_shard, dtype=np.int64), 1, 1, 0, buffer)
    return [int(i) for i in ids], time.process_time() - began, open_handles()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--per-shard", type=int, default=500)
    parser.add_argument("--buffer", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.shards, args.per_shard, args.buffer, args.batch = 8, 200, 1024, 64
    total = args.shards * args.per_shard
    rows, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        urls = write_sorted(Path(tmp), args.shards, args.per_shard)
        runs = {"ours": lambda: read_ours(urls, args.buffer, 0), "ours-1": lambda: read_ours(urls, args.buffer, 1),
                "webdataset": lambda: read_webdataset(urls, args.buffer),
                "sequential": lambda: (list(range(total)), 0.0, open_handles())}
        get, where = py1e()
        if get is not None:
            runs["mosaicml-py1e"] = lambda: read_mosaic(get, args.shards, args.per_shard, args.buffer)
            notes.append(f"mosaicml-py1e: MosaicML's own get_shuffle_py1e ({where}); an order computed, not a "
                         "reader: CPU and handles are those of computing it")
        else:
            notes.append(f"mosaicml-py1e skipped: {where}")
        for name, run in runs.items():
            order, cpu, handles = run()
            assert sorted(order) == list(range(total)), f"{name} did not read every sample once"
            rho, shards_per_batch, labels_per_batch = quality(order, args.shards, args.per_shard, args.batch)
            rows.append([name, round(rho, 3), round(shards_per_batch, 1), round(labels_per_batch, 1),
                         round(cpu / total * 1e6, 1), handles])
    print(f"SETUP  {args.shards} shards x {args.per_shard} samples sorted by {LABELS} labels; buffer {args.buffer} "
          f"samples; batch {args.batch}")
    columns = ["system", "|rank corr| read vs source", "shards per batch", "labels per batch", "CPU us/sample",
               "open handles"]
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(str(x) for x in row))
    for note in notes:
        print(f"note: {note}")
    sweep = []
    with tempfile.TemporaryDirectory() as tmp:
        urls = write_sorted(Path(tmp), args.shards, args.per_shard)
        for open_shards in ((1, 8) if args.quick else (1, 4, 8, 16)):
            for buffer in ((1024,) if args.quick else (1024, 4096, 16384)):
                order, cpu, handles = read_ours(urls, buffer, open_shards)
                rho, shards_per_batch, labels_per_batch = quality(order, args.shards, args.per_shard, args.batch)
                sweep.append([open_shards, buffer, round(rho, 3), round(shards_per_batch, 1),
                              round(labels_per_batch, 1), round(cpu / total * 1e6, 1)])
    sweep_columns = ["open_shards", "shuffle_buffer", "|rank corr|", "shards per batch", "labels per batch",
                     "CPU us/sample"]
    print("\nours by open_shards x shuffle_buffer\n" + " | ".join(sweep_columns))
    for row in sweep:
        print(" | ".join(str(x) for x in row))
    if args.json:
        doc = benchjson.document("shuffle", quick=args.quick)
        doc["tables"].append(benchjson.table(
            f"shuffle quality at equal memory ({args.shards} shards x {args.per_shard} sorted samples, buffer "
            f"{args.buffer}, batch {args.batch})", columns, rows,
            notes=notes + ["ours: the planner's whole pipeline (read, parse, pack, plan), so its CPU counts more "
                           "work than a shuffle", f"a perfect shuffle gives |rank corr| ~0, "
                           f"{min(args.batch, args.shards)} shards and {LABELS} labels per batch"]))
        doc["tables"].append(benchjson.table("ours by open_shards x shuffle_buffer", sweep_columns, sweep))
        benchjson.write(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
