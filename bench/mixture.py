"""Realised vs requested mixture proportions over a run, by the service's own planner.

Three synthetic LAION-style datasets of different sizes and content (captioned images, speech
clips with captions, long text-only documents) are blended with weights 0.6 / 0.25 / 0.15. The
job's planner (the same code that serves a job; planning reads headers, no pixels are decoded)
plans one epoch; the benchmark prints each dataset's share of the samples and of the tokens at
10%, 25%, 50% and 100% of the epoch, for weights by samples and by tokens, and how long the epoch
is under each epoch rule.

    .venv/bin/python bench/mixture.py [--quick] [--json FILE]   # writes data/mix-bench/ once

``--quick`` is a smoke run on a twentieth of each dataset (one shard each, under data/bench-quick/),
not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))  # benchjson, when loaded from a test rather than run

import benchjson  # noqa: E402

from disttrain_api.config import DatasetConfig, JobConfig  # noqa: E402
from disttrain_tools import synth  # noqa: E402
from preprocess_service.service.job import Job  # noqa: E402

DATASETS = {  # name: (synthetic content, weight)
    "images": (synth.SynthConfig(num_shards=4, samples_per_shard=300, seed=1, audio_share=0.0), 0.60),
    "speech": (synth.SynthConfig(num_shards=2, samples_per_shard=200, seed=2, audio_share=1.0, conversation_share=0.0,
                                 interleaved_share=0.0, generate_share=0.0), 0.25),
    "text": (synth.SynthConfig(num_shards=1, samples_per_shard=300, seed=3, audio_share=0.0, interleaved_share=0.0,
                               generate_share=0.0, text_share=1.0, conversation_share=0.0), 0.15),
}


def quick_content(content: synth.SynthConfig) -> synth.SynthConfig:
    """The same content at a twentieth of the samples, in one shard (--quick)."""
    return dataclasses.replace(content, num_shards=1,
                               samples_per_shard=content.num_shards * content.samples_per_shard // 20)


def datasets(root: Path, quick: bool = False) -> tuple[DatasetConfig, ...]:
    out = []
    for name, (content, weight) in DATASETS.items():
        synth.ensure_dataset(root / name, quick_content(content) if quick else content)
        out.append(DatasetConfig(name=name, shards=(str(root / name),), weight=weight))
    return tuple(out)


def plan_epoch(config: JobConfig) -> tuple[list[tuple[int, int]], float]:
    """(dataset, tokens) of every planned document in order, and the planning seconds."""
    job = Job(config)
    start = time.perf_counter()
    job.plan_all()
    seconds = time.perf_counter() - start
    drawn = [(doc.dataset, doc.num_tokens) for s in range(job.num_steps()) for doc in job.step_plan(s).documents()]
    return drawn, seconds


def shares(drawn: list[tuple[int, int]], num: int, upto: int) -> list[tuple[float, float]]:
    head = drawn[:upto]
    samples = [sum(1 for d, _ in head if d == i) for i in range(num)]
    tokens = [sum(t for d, t in head if d == i) for i in range(num)]
    return [(s / max(1, sum(samples)), t / max(1, sum(tokens))) for s, t in zip(samples, tokens)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="where the datasets are written once (default data/mix-bench, "
                                                  "data/bench-quick/mix with --quick)")
    parser.add_argument("--quick", action="store_true", help="smoke run: a twentieth of each dataset, in one shard")
    parser.add_argument("--json", type=Path, help="also write the tables here")
    args = parser.parse_args(argv)
    data = args.data or REPO / "data" / ("bench-quick/mix" if args.quick else "mix-bench")
    mix = datasets(data, quick=args.quick)
    names = [d.name for d in mix]
    weights = [d.weight / sum(x.weight for x in mix) for d in mix]
    base = dict(datasets=mix, seq_len=8192, dp_size=4, num_microbatches=4, seed=0)
    contents = [quick_content(c) if args.quick else c for c, _ in DATASETS.values()]
    sizes = [c.num_shards * c.samples_per_shard for c in contents]
    epoch_samples = 50 if args.quick else 1000
    doc = benchjson.document("mixture", quick=args.quick)
    print("datasets: " + ", ".join(f"{n} ({size} samples, weight {w:.2f})"
                                   for n, size, w in zip(names, sizes, weights)))
    columns = ["progress"] + [f"{n} {kind}" for n in names for kind in ("samples", "tokens")]
    for mix_by in ("samples", "tokens"):
        drawn, seconds = plan_epoch(JobConfig(**base, mix_by=mix_by))
        print(f"\nmix_by={mix_by}, mix_epoch=first_exhausted: {len(drawn)} samples in the epoch "
              f"(planned in {seconds:.1f} s)")
        print(f"  {'progress':>9} " + " ".join(f"{n + ' samples':>15} {n + ' tokens':>14}" for n in names))
        rows = []
        for fraction in (0.10, 0.25, 0.50, 1.00):
            row = shares(drawn, len(names), max(1, int(len(drawn) * fraction)))
            print(f"  {fraction:>9.0%} " + " ".join(f"{s:>15.1%} {t:>14.1%}" for s, t in row))
            rows.append([f"{fraction:.0%}"] + [round(x, 4) for pair in row for x in pair])
        print(f"  {'weights':>9} " + " ".join(f"{w:>15.1%} {'':>14}" for w in weights))
        rows.append(["weights"] + [x for w in weights for x in (round(w, 4), None)])
        doc["tables"].append(benchjson.table(
            f"mix_by={mix_by}, mix_epoch=first_exhausted: shares of the samples and tokens drawn so far",
            columns, rows, notes=[f"{len(drawn)} samples in the epoch, planned in {seconds:.1f} s",
                                  "datasets: " + ", ".join(f"{n} ({size} samples)" for n, size in zip(names, sizes))]))
    rule_rows = []
    for rule in ({"mix_epoch": "all_exhausted"}, {"mix_epoch_samples": epoch_samples}):
        drawn, _ = plan_epoch(JobConfig(**base, **rule))
        counts = [sum(1 for d, _ in drawn if d == i) for i in range(len(names))]
        label = ", ".join(f"{k}={v}" for k, v in rule.items())
        print(f"\n{label}: {len(drawn)} samples: " + ", ".join(f"{n} {c} ({c / len(drawn):.1%})"
                                                          for n, c in zip(names, counts)))
        rule_rows.append([label, len(drawn), *counts])
    doc["tables"].append(benchjson.table("epoch length under other epoch rules", ["rule", "samples", *names],
                                         rule_rows))
    benchjson.write(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
