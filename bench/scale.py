"""LAION-2B on one job: planning cost, memory and state along a 2.3-billion-sample epoch.

    .venv/bin/python bench/scale.py [--shards 230000] [--rows 10000] [--stretch 3000000] [--quick] [--json FILE]

The dataset is synthetic and lazy: --shards shards of about --rows samples each (LAION-2B-en is
about 230,000 img2dataset shards of 10,000 rows), every shard's rows a function of its index
(caption length, image width and height, and how many rows failed to download, all seeded by the
shard's index). Nothing of that size is written to disk, and there are no tars: samples are
planned from their metadata, as from img2dataset's parquet. A planner reaches a far position by
seeking (EpochPlanner.seek: the shard order and the waves of open shards are a function of the
position, given the shards' sizes), not by planning every sample before it.

Printed:
- planning CPU per sample (process time: reading the rows, parsing, packing, pricing, and the
  batch planner "lpt") over --stretch samples from the epoch's start and from sample 1e9, and the
  process's resident memory after each (memory independent of the position: the same); and from
  1e9 with the default batch planner ("ours", which also searches the 1F1B simulator);
- the planner's state at 1e3, 1e6, 1e8 and 1e9 samples into the epoch: JSON bytes, save time
  (state_dict + json.dumps), load time (json.loads + load_state_dict into a new planner, which
  rebuilds the open shards' key sets), and the time to resume (load, then plan the next step);
- dedup "pass" (exact duplicate keys across shards): its memory (8 bytes per sample read this
  pass) and its restore (reading the keys of every shard read so far) are not functions of the
  position; measured over a few shards and extrapolated to 1e9, labelled;
- shard expansion: a brace pattern of --shards https names and of a million, and a folder of
  100,000 empty tars, resolved as OpenJob does, held lazily (a pattern as its pattern, a folder
  as one string of names) against every name made and checked at once: time to open, memory
  held, and the cost of making one name when its shard opens.

Ratios and per-sample figures, not seconds, are what to compare: these machines are noisy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchjson

from disttrain_api.config import JobConfig
from preprocess_service.adapters.io import sources
from preprocess_service.adapters.io.sources import ShardPolicy
from preprocess_service.adapters.media.imaging import num_image_tokens, target_size
from preprocess_service.core.planner import EpochPlanner, _key_hash, keys_by_reading
from preprocess_service.core.sample import Document, ImageRef, TextSegment

POSITIONS = (1_000, 1_000_000, 100_000_000, 1_000_000_000)


class LazyManifests:
    """A DocumentSource over synthetic img2dataset shards: shard i's rows are a function of i."""

    fingerprint = ""

    def __init__(self, num_shards: int, rows: int, config: JobConfig):
        self.num_shards, self.rows, self.config = num_shards, rows, config
        self.urls = [f"/laion/{i:06d}.tar" for i in range(num_shards)]
        self._cache: tuple[int, tuple] | None = None

    def sizes(self) -> np.ndarray:
        """Successful rows of every shard (img2dataset: about 90 % of the rows download)."""
        index = np.arange(self.num_shards, dtype=np.uint64)
        failed = (index * np.uint64(2654435761) % np.uint64(self.rows // 5)).astype(np.int64)
        return self.rows - failed

    def _shard(self, index: int) -> tuple:
        if self._cache is None or self._cache[0] != index:
            size = int(self.sizes()[index]) if self.num_shards < 2 else self.rows - int(
                (np.uint64(index) * np.uint64(2654435761)) % np.uint64(self.rows // 5))
            rng = np.random.default_rng([index, 0x1A10])
            captions = np.clip(rng.lognormal(3.6, 0.6, size), 4, 400).astype(np.int64)
            widths = np.clip(rng.lognormal(6.2, 0.5, size), 32, 4096).astype(np.int64)
            heights = np.clip(widths * rng.uniform(0.5, 1.6, size), 32, 4096).astype(np.int64)
            self._cache = (index, (size, captions, widths, heights))
        return self._cache[1]

    def iter_shard(self, url, on_problem, start=None, dataset=None):
        index = int(url[-10:-4])
        size, captions, widths, heights = self._shard(index)
        for row in range(int((start or {}).get("samples", 0)), size):
            yield {"__key__": f"{index:06d}{row:04d}", "__url__": url,
                   "row": (captions[row], widths[row], heights[row])}

    def read_samples(self, url, keys):
        return {}

    def shard_keys(self, url, limit=None):
        return keys_by_reading(self, url, limit)

    def parse(self, sample: dict) -> Document:
        caption, width, height = (int(x) for x in sample["row"])
        h, w = target_size(width, height, self.config.image)
        image = ImageRef(member="jpg", height=h, width=w, tokens=num_image_tokens(h, w, self.config.image))
        text = TextSegment(member="txt", ids=np.zeros(caption, dtype=np.int32))
        return Document(key=sample["__key__"], shard=sample["__url__"], segments=(image, text))

    def skipped(self, problem) -> None:
        pass


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def planner_at(source: LazyManifests, config: JobConfig, position: int, sizes: np.ndarray) -> EpochPlanner:
    planner = EpochPlanner(config, source.urls, source)
    if position:
        planner.seek(position, sizes, step=0)
    return planner


def stretch(planner: EpochPlanner, samples: int) -> tuple[float, int, int]:
    """(CPU seconds, samples planned, steps) planning at least ``samples`` samples."""
    began, planned, steps = time.process_time(), 0, 0
    while planned < samples:
        plan = planner.next_plan()
        if plan is None:
            break
        planned += sum(len(seq.documents) for seq in plan.sequences)
        steps += 1
    return time.process_time() - began, planned, steps


def expansion_rows(args) -> list[list]:
    """Resolving a brace pattern of https names and a local folder of empty tars, lazily (the
    default: a pattern over EAGER_NAMES is held as its pattern, a folder as one string) against
    every name at once (EAGER_NAMES raised past the count; a folder as a list of its names)."""
    rows = []
    policy = ShardPolicy(allowed_schemes=("file", "https"), max_shards=1_000_000)
    lazy_limit = sources.EAGER_NAMES
    cases = [(f"{n:,} https", [f"https://data.example/laion/{{000000..{n - 1:06d}}}.tar"])
             for n in ((5_000, 20_000) if args.quick else (args.shards, 1_000_000))]  # quick: above EAGER_NAMES
    with tempfile.TemporaryDirectory() as tmp:
        files = 5_000 if args.quick else 100_000
        for i in range(files):
            open(os.path.join(tmp, f"{i:06d}.tar"), "wb").close()
        cases.append((f"{files:,} in a folder", [tmp]))
        for label, specs in cases:
            for mode in ("lazy", "eager"):
                sources.EAGER_NAMES = lazy_limit if mode == "lazy" else 1 << 30
                began = time.perf_counter()
                names = sources.resolve_names(specs, policy)
                if mode == "eager":
                    names = list(names)  # a folder: every name as its own string, as before
                seconds = time.perf_counter() - began
                del names
                tracemalloc.start()
                names = sources.resolve_names(specs, policy)
                if mode == "eager":
                    names = list(names)
                held = tracemalloc.get_traced_memory()[0] / 2**20
                tracemalloc.stop()
                picks = np.random.default_rng(0).integers(0, len(names), 2000)
                began = time.perf_counter()
                for i in picks:
                    names[int(i)]
                per_name = (time.perf_counter() - began) / len(picks) * 1e6
                rows.append([label, mode, round(seconds, 2), round(held, 1), round(per_name, 2)])
                del names
    sources.EAGER_NAMES = lazy_limit
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=230_000)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--stretch", type=int, default=3_000_000, help="samples planned per stretch")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 20,000-sample stretches, keys of 5 shards, 5,000 and 20,000 names")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.stretch = 20_000
    config = JobConfig(shards=("/laion/{000000..229999}.tar",), seq_len=8192, dp_size=8, num_microbatches=8,
                       dedup="shard", reorder_algorithm="lpt")
    source = LazyManifests(args.shards, args.rows, config)
    sizes = source.sizes()
    total = int(sizes.sum())
    print(f"SETUP  {args.shards} shards, {total:,} samples (lazy rows, no tars); seq_len {config.seq_len}, "
          f"global batch {config.global_batch} sequences; block {config.shuffle_buffer} documents, "
          f"{config.shards_open} open shards; dedup {config.dedup!r}; batch planner {config.reorder_algorithm!r}")
    rows_cpu = []
    default = dataclasses.replace(config, reorder_algorithm=JobConfig(shards=("x",)).reorder_algorithm)
    for position, job in ((0, config), (1_000_000_000, config), (1_000_000_000, default)):
        planner = planner_at(source, job, position, sizes)
        before = rss_mib()
        cpu, planned, steps = stretch(planner, args.stretch)
        rows_cpu.append([f"{position:.0e}" if position else "0", job.reorder_algorithm, planned, steps,
                         round(cpu / planned * 1e6, 1), round(before), round(rss_mib())])
    print(f"\n{'from sample':>12} {'planner':>8} {'samples':>9} {'steps':>6} {'CPU us/sample':>14} "
          f"{'RSS before MiB':>15} {'RSS after MiB':>14}")
    for row in rows_cpu:
        print(" ".join(f"{x:>{w}}" for x, w in zip(row, (12, 8, 9, 6, 14, 15, 14))))

    rows_state = []
    for position in POSITIONS:
        planner = planner_at(source, config, position, sizes)
        began = time.perf_counter()
        text = json.dumps(planner.state_dict())
        save = time.perf_counter() - began
        began = time.perf_counter()
        fresh = EpochPlanner(config, source.urls, source)
        fresh.load_state_dict(json.loads(text))
        load = time.perf_counter() - began
        began = time.perf_counter()
        fresh2 = EpochPlanner(config, source.urls, source)
        fresh2.load_state_dict(json.loads(text))
        first = fresh2.next_plan()
        resume = time.perf_counter() - began
        assert first is not None and first.sequences[0].documents
        rows_state.append([f"{position:.0e}", len(text), round(save * 1e3, 2), round(load * 1e3, 1),
                           round(resume, 3)])
    print(f"\n{'position':>9} {'state bytes':>12} {'save ms':>8} {'load ms':>8} {'resume s':>9}")
    for row in rows_state:
        print(f"{row[0]:>9} {row[1]:>12} {row[2]:>8} {row[3]:>8} {row[4]:>9}")

    # dedup "pass": the part that is not a function of the position
    began = time.perf_counter()
    keys = 0
    for url in source.urls[:5 if args.quick else 20]:
        for key in source.shard_keys(url):
            _key_hash(key)
            keys += 1
    rate = keys / (time.perf_counter() - began)
    print(f"\ndedup 'pass': key replay {rate:,.0f} keys/s -> restore at 1e9 about {1e9 / rate:,.0f} s "
          f"(extrapolated); memory 8 bytes per sample read this pass -> {8e9 / 2**30:.1f} GiB at 1e9 (by design)")

    expansion = expansion_rows(args)
    print("\nshard expansion as OpenJob does it (names made, parsed and checked), held lazily vs every name "
          "at once (the eager path small patterns take)")
    print(f"{'names':>22} {'mode':>6} {'open s':>7} {'held MiB':>9} {'us per name made':>17}")
    for row in expansion:
        print(" ".join(f"{x:>{w}}" for x, w in zip(row, (22, 6, 7, 9, 17))))

    cpu_goal = max(r[4] for r in rows_cpu)
    state_goal = max(r[1] for r in rows_state)
    resume_1e9 = rows_state[-1][4]
    goals = [["planning CPU per sample (us)", cpu_goal, 50, cpu_goal <= 50],
             ["state bytes (any position)", state_goal, 65_536, state_goal <= 65_536],
             ["resume at 1e9 (s)", resume_1e9, 1.0, resume_1e9 <= 1.0],
             ["RSS after a stretch at 1e9 / at 0", round(rows_cpu[1][6] / rows_cpu[0][6], 2), 1.1,
              rows_cpu[1][6] / rows_cpu[0][6] <= 1.1]]
    print(f"\n{'goal':<36} {'measured':>10} {'limit':>8} {'met':>5}")
    for name, value, limit, met in goals:
        print(f"{name:<36} {value:>10} {limit:>8} {'yes' if met else 'NO':>5}")
    if args.json:
        doc = benchjson.document("scale", quick=args.quick)
        doc["tables"] += [
            benchjson.table("planning along the epoch", ["from sample", "batch planner", "samples", "steps",
                                                         "CPU us/sample", "RSS before MiB", "RSS after MiB"], rows_cpu,
                            notes=["CPU: process time of reading the rows, parsing, packing, pricing and the batch "
                                   "planner with its simulation of the plan and of the arrival order"]),
            benchjson.table("planner state by position", ["position", "state bytes", "save ms", "load ms",
                                                          "resume s"], rows_state,
                            notes=["resume = load the state into a new planner and plan the next step (one block "
                                   "read again)", "positions reached by seeking, not by planning"]),
            benchjson.table("dedup 'pass' (extrapolated, labelled)", ["metric", "value"],
                            [["key replay keys/s", round(rate)], ["restore at 1e9 s (extrapolated)", round(1e9 / rate)],
                             ["memory at 1e9 GiB (8 bytes/sample)", round(8e9 / 2**30, 1)]]),
            benchjson.table("shard expansion", ["names", "mode", "open s", "held MiB", "us per name made"],
                            expansion, notes=["open: resolve_names as OpenJob calls it; held: what the result "
                                              "keeps (tracemalloc); a name is made when its shard opens"]),
            benchjson.table("goals", ["goal", "measured", "limit", "met"], goals)]
        benchjson.write(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
