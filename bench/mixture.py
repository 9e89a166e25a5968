"""Realised vs requested mixture proportions over a run, by the service's own planner.

Three synthetic LAION-style datasets of different sizes and content (captioned images, speech
clips with captions, long text-only documents) are blended with weights 0.6 / 0.25 / 0.15. The
job's planner (the same code that serves a job; planning reads headers, no pixels are decoded)
plans one epoch; the benchmark prints each dataset's share of the samples and of the tokens at
10%, 25%, 50% and 100% of the epoch, for weights by samples and by tokens, and how long the epoch
is under each epoch rule.

    .venv/bin/python bench/mixture.py            # writes data/mix-bench/ once (about 30 s)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from disttrain_api.config import DatasetConfig, JobConfig  # noqa: E402
from preprocess_service.adapters import synth  # noqa: E402
from preprocess_service.service.job import Job  # noqa: E402

DATASETS = {  # name: (synthetic content, weight)
    "images": (synth.SynthConfig(num_shards=4, samples_per_shard=300, seed=1, audio_share=0.0), 0.60),
    "speech": (synth.SynthConfig(num_shards=2, samples_per_shard=200, seed=2, audio_share=1.0, conversation_share=0.0,
                                 interleaved_share=0.0, generate_share=0.0), 0.25),
    "text": (synth.SynthConfig(num_shards=1, samples_per_shard=300, seed=3, audio_share=0.0, interleaved_share=0.0,
                               generate_share=0.0, text_share=1.0, conversation_share=0.0), 0.15),
}


def datasets(root: Path) -> tuple[DatasetConfig, ...]:
    out = []
    for name, (content, weight) in DATASETS.items():
        synth.ensure_dataset(root / name, content)
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
    parser.add_argument("--data", type=Path, default=REPO / "data" / "mix-bench")
    args = parser.parse_args(argv)
    mix = datasets(args.data)
    names = [d.name for d in mix]
    weights = [d.weight / sum(x.weight for x in mix) for d in mix]
    base = dict(datasets=mix, seq_len=8192, dp_size=4, num_microbatches=4, seed=0)
    sizes = [c.num_shards * c.samples_per_shard for c, _ in DATASETS.values()]
    print("datasets: " + ", ".join(f"{n} ({size} samples, weight {w:.2f})"
                                   for n, size, w in zip(names, sizes, weights)))
    for mix_by in ("samples", "tokens"):
        drawn, seconds = plan_epoch(JobConfig(**base, mix_by=mix_by))
        print(f"\nmix_by={mix_by}, mix_epoch=first_exhausted: {len(drawn)} samples in the epoch "
              f"(planned in {seconds:.1f} s)")
        print(f"  {'progress':>9} " + " ".join(f"{n + ' samples':>15} {n + ' tokens':>14}" for n in names))
        for fraction in (0.10, 0.25, 0.50, 1.00):
            row = shares(drawn, len(names), max(1, int(len(drawn) * fraction)))
            print(f"  {fraction:>9.0%} " + " ".join(f"{s:>15.1%} {t:>14.1%}" for s, t in row))
        print(f"  {'weights':>9} " + " ".join(f"{w:>15.1%} {'':>14}" for w in weights))
    for rule in ({"mix_epoch": "all_exhausted"}, {"mix_epoch_samples": 1000}):
        drawn, _ = plan_epoch(JobConfig(**base, **rule))
        counts = [sum(1 for d, _ in drawn if d == i) for i in range(len(names))]
        label = ", ".join(f"{k}={v}" for k, v in rule.items())
        print(f"\n{label}: {len(drawn)} samples: " + ", ".join(f"{n} {c} ({c / len(drawn):.1%})"
                                                          for n, c in zip(names, counts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
