"""Resume cost and held memory along a long epoch.

    .venv/bin/python bench/resume.py [--shards 48] [--per-shard 500] [--early 300] [--late 1000]
                                     [--repeats 3] [--quick] [--json FILE]

A job over one long epoch (--shards x --per-shard samples written here: captions and a small JPEG
each, so that a step packs many samples and the epoch has many steps; SETUP prints how many) is
planned step by step while every rank acknowledges each step, as a trainer acknowledging its
checkpoints does. Printed:

- resume time at step --early and at step --late, with dedup "pass" (the default: the duplicate-key
  hashes of every shard read so far are rebuilt from their tar headers) and "shard": a new Job
  loads the state the first job had at that acknowledged step (``Job.state_dict()``) and plans
  the step. Baseline in the same run: planning again from step 0 up to that step.
- the state's size at those steps;
- Python heap held by the job after N steps (tracemalloc), with acknowledgements (plans dropped)
  and without (the baseline: every plan kept, as before).

Ratios, not seconds, are what to compare: these machines are noisy. ``--quick`` is a smoke run (2
shards of 400 samples, steps 2 and 30, one repeat, held memory up to step 10), not a measurement; it
writes this bench's own tiny samples rather than benchjson.quick_shards', which hold too few samples
for a long epoch.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import io
import json
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchjson

from disttrain_api.config import JobConfig
from preprocess_service.service.job import Job


def write_shards(out: Path, num_shards: int, per_shard: int) -> None:
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(buf, "JPEG")
    jpeg = buf.getvalue()
    words = "a photo of the sea dog city red blue mountain river night street market old new".split()
    for shard in range(num_shards):
        with wds.TarWriter(str(out / f"{shard:05d}.tar")) as writer:
            for i in range(per_shard):
                caption = " ".join(rng.choice(words, int(rng.integers(8, 60))))
                writer.write({"__key__": f"{shard:05d}{i:05d}", "jpg": jpeg, "txt": caption.encode(),
                              "json": json.dumps({"caption": caption}).encode()})


def config_for(shards: Path) -> JobConfig:
    return JobConfig(shards=(str(shards),), seq_len=1024, dp_size=2, num_microbatches=2, seqs_per_microbatch=1,
                     pack_window=8, reorder_algorithm="lpt")


def plan_and_acknowledge(config: JobConfig, steps: set[int], acknowledge: bool = True) -> tuple[dict, int]:
    """Plans the epoch, acknowledging every step; returns {step: state at that acknowledged step}."""
    job = Job(config)
    states, step = {}, 0
    while job.step_plan(step) is not None:
        if acknowledge:
            for rank in range(config.dp_size):
                job.acknowledge(rank, step + 1)
        if step + 1 in steps:
            states[step + 1] = json.loads(json.dumps(job.state_dict()))
        step += 1
    return states, step


def time_resume(config: JobConfig, state: dict, step: int) -> float:
    began = time.perf_counter()
    job = Job(config)
    job.load_state_dict(state)
    assert job.step_plan(step) is not None
    return time.perf_counter() - began


def time_replan(config: JobConfig, step: int) -> float:
    began = time.perf_counter()
    job = Job(config)
    assert job.step_plan(step) is not None
    return time.perf_counter() - began


def held_memory(config: JobConfig, checkpoints: list[int], acknowledge: bool) -> dict[int, float]:
    """MiB of Python heap allocated since the job was created, after each checkpoint step."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    job = Job(config)
    out, step = {}, 0
    while step < max(checkpoints) and job.step_plan(step) is not None:
        if acknowledge:
            for rank in range(config.dp_size):
                job.acknowledge(rank, step + 1)
        step += 1
        if step in checkpoints:
            gc.collect()
            out[step] = (tracemalloc.get_traced_memory()[0] - base) / 2**20
    tracemalloc.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=48)
    parser.add_argument("--per-shard", type=int, default=500)
    parser.add_argument("--early", type=int, default=300)
    parser.add_argument("--late", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 shards of 400 samples, resume at steps 2 and 30, one repeat, "
                             "held memory after 2, 5 and 10 steps")
    parser.add_argument("--json", type=Path, help="also write the tables here")
    args = parser.parse_args(argv)
    memory_steps = (10, 100, 300, 1000)
    if args.quick:
        args.shards, args.per_shard, args.early, args.late, args.repeats = 2, 400, 2, 30, 1
        memory_steps = (2, 5, 10)  # under tracemalloc a step is slow: steps to 30 took half the run
    with tempfile.TemporaryDirectory() as tmp:
        shards = Path(tmp)
        write_shards(shards, args.shards, args.per_shard)
        config = config_for(shards)
        by_shard = dataclasses.replace(config, dedup="shard")
        states, num_steps = plan_and_acknowledge(config, {args.early, args.late})
        late = min(args.late, num_steps - 1)
        if late != args.late:
            states, _ = plan_and_acknowledge(config, {args.early, late})
        shard_states, _ = plan_and_acknowledge(by_shard, {args.early, late})
        setup = (f"one epoch of {args.shards * args.per_shard} samples, {num_steps} steps; "
                 f"global batch {config.global_batch} sequences of {config.seq_len} tokens; "
                 f"blocks of {config.shuffle_buffer} documents (after the ramp); planner state every "
                 f"{Job(config).plans.snapshot_every} step")
        print(f"SETUP  {setup}")
        rows = []
        for dedup, job_config, saved in (("pass", config, states), ("shard", by_shard, shard_states)):
            for step in (args.early, late):
                resume = [time_resume(job_config, saved[step], step) for _ in range(args.repeats)]
                replan = [time_replan(job_config, step) for _ in range(args.repeats)]
                size = len(json.dumps(saved[step]))
                rows.append((dedup, step, statistics.median(resume), statistics.median(replan), size))
        print(f"\n{'dedup':>6} {'resume at step':>15} {'from state s':>13} {'replan from 0 s':>16} {'speed-up':>9} "
              f"{'state KB':>9}")
        for dedup, step, resume, replan, size in rows:
            print(f"{dedup:>6} {step:>15} {resume:>13.3f} {replan:>16.3f} {replan / resume:>8.1f}x {size / 1024:>9.1f}")
        early, late_row, shard_early, shard_late = rows
        results = [
            [f"dedup shard: resume time at step {late_row[1]} / at step {early[1]}",
             round(shard_late[2] / shard_early[2], 2),
             "1.0 within noise: each reads one block again from its state's anchor"],
            [f"dedup pass: resume time at step {late_row[1]} / at step {early[1]}", round(late_row[2] / early[2], 2),
             "grows with the position: the key hashes of every shard read so far are rebuilt (their tar headers)"],
            [f"replan from step 0: at step {late_row[1]} / at step {early[1]}", round(late_row[3] / early[3], 1),
             "the baseline"]]
        for name, value, goal in results:
            print(f"RESULT {name}: {value}x ({goal})")
        checkpoints = [c for c in memory_steps if c < num_steps]
        kept = held_memory(config, checkpoints, acknowledge=True)
        held = held_memory(config, checkpoints, acknowledge=False)
        print(f"\n{'after N steps':>14} {'acknowledged MiB':>17} {'never acknowledged MiB':>23}")
        for n in checkpoints:
            print(f"{n:>14} {kept[n]:>17.1f} {held[n]:>23.1f}")
        print(f"RESULT memory held after {checkpoints[-1]} / after {checkpoints[0]} steps: "
              f"{kept[checkpoints[-1]] / kept[checkpoints[0]]:.2f}x with acknowledgements (goal: flat), "
              f"{held[checkpoints[-1]] / held[checkpoints[0]]:.1f}x keeping every plan")
        results += [[f"memory held after {checkpoints[-1]} / after {checkpoints[0]} steps, acknowledged",
                     round(kept[checkpoints[-1]] / kept[checkpoints[0]], 2), "flat (1.0)"],
                    [f"memory held after {checkpoints[-1]} / after {checkpoints[0]} steps, every plan kept",
                     round(held[checkpoints[-1]] / held[checkpoints[0]], 1), "the baseline"]]
    doc = benchjson.document("resume", quick=args.quick)
    doc["tables"] += [
        benchjson.table("resume from the acknowledged step's state vs replanning from step 0",
                        ["dedup", "resume at step", "from state s", "replan from 0 s", "speed-up", "state KB"],
                        [[dedup, step, round(resume, 4), round(replan, 4), round(replan / resume, 1),
                          round(size / 1024, 1)] for dedup, step, resume, replan, size in rows],
                        notes=[setup, f"medians of {args.repeats} repeats"]),
        benchjson.table("Python heap held by the job after N steps (tracemalloc)",
                        ["after N steps", "acknowledged MiB", "never acknowledged MiB"],
                        [[n, round(kept[n], 2), round(held[n], 2)] for n in checkpoints]),
        benchjson.table("results", ["ratio", "value", "goal"], results,
                        notes=["ratios, not seconds, are what to compare: these machines are noisy"])]
    benchjson.write(args.json, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
