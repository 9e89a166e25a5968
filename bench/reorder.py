"""Reordering algorithms side by side on LAION-like cost instances, judged by the exact 1F1B simulator.

    python bench/reorder.py [--seeds 2] [--quick] [--json FILE]

For every configuration (D ranks in {8, 32, 128}, M microbatches in {8, 32}, P stages in {4, 8},
S sequences per microbatch in {1, 2, 4}) and seed it prints each algorithm's iteration time as a
ratio to the batch lower bound (1.000 = provably optimal), and planning time per global batch.
``--json FILE`` writes every instance and plan in the disttrain-reorder-* JSON forms.

Instance generator (assumptions; all times are forward seconds per packed 8192-token sequence):
* images per sequence: 25% text-only; else 1 + NegativeBinomial(2, 0.25) (mean 7, long tail), at
  most 24;
* image tokens: lognormal, median 300, sigma 0.7, clipped to [16, 1280]; a sequence's image tokens
  are scaled down to at most 7000 (the rest of the 8192 tokens is text);
* encoder = sum over images of (1.2e-6 t + 1.5e-9 t^2): superlinear in image tokens (attention);
* backbone = 6e-6 * 8192 + 2e-10 * sum over documents of len^2; documents are each image with a
  50-token caption, and text documents of lognormal length (median 1000) filling the rest;
* generator: 20% of sequences hold 1-4 images to generate, 256^2 (0.015 s) or 512^2 (0.05 s) each;
* backward = 2 x forward for all modules; p2p latency 0.1 ms;
* stage maps: P=4 ["enc", "bb/2", "bb/2", "gen"]; P=8 ["enc", "bb/6" x 6, "gen"].
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from preprocess_service.reorder.instance import PLANNERS, Instance, evaluate, plan_instance  # noqa: E402
from preprocess_service.simulate import StageModel  # noqa: E402

STAGE_MAPS = {4: ("enc", "bb/2", "bb/2", "gen"), 8: ("enc", *["bb/6"] * 6, "gen")}
ALGORITHMS = ("random", "arrival", "paper", "lpt", "ours")


def sequence_costs(num: int, rng: np.random.Generator) -> np.ndarray:
    """float[num, 3]: enc, bb, gen forward seconds of LAION-like packed sequences (see module doc)."""
    out = np.zeros((num, 3))
    for i in range(num):
        k = 0 if rng.random() < 0.25 else min(24, 1 + int(rng.negative_binomial(2, 0.25)))
        tokens = np.clip(rng.lognormal(np.log(300), 0.7, k), 16, 1280)
        if tokens.sum() > 7000:
            tokens *= 7000 / tokens.sum()
        docs = list(tokens + 50)
        text = 8192 - sum(docs)
        while text > 0:
            length = min(text, max(16.0, rng.lognormal(np.log(1000), 0.8)))
            docs.append(length)
            text -= length
        out[i, 0] = (1.2e-6 * tokens + 1.5e-9 * tokens**2).sum()
        out[i, 1] = 6e-6 * 8192 + 2e-10 * float(np.sum(np.square(docs)))
        if rng.random() < 0.2:
            out[i, 2] = float(rng.choice([0.015, 0.05], size=rng.integers(1, 5)).sum())
    return out


def make_instance(D: int, M: int, P: int, S: int, seed: int) -> Instance:
    rng = np.random.default_rng([D, M, P, S, seed])
    model = StageModel(stage_map=STAGE_MAPS[P], bwd_factor=(2.0, 2.0, 2.0), p2p_latency=1e-4)
    return Instance(D=D, M=M, S=S, model=model, costs=sequence_costs(D * M * S, rng))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="D in {8, 32} only")
    parser.add_argument("--json", type=Path, help="write every instance and plan here")
    args = parser.parse_args(argv)
    dims = list(itertools.product((8, 32) if args.quick else (8, 32, 128), (8, 32), (4, 8), (1, 2, 4)))
    print(f"{'D':>4} {'M':>3} {'P':>2} {'S':>2} {'B':>6} | " + " ".join(f"{a:>8}" for a in ALGORITHMS)
          + " | ours ms  (iteration time / lower bound, mean over seeds)")
    ratios = {a: [] for a in ALGORITHMS}
    ours_not_worse, ours_ms_1024, dump = 0, [], []
    for D, M, P, S in dims:
        row = {a: [] for a in ALGORITHMS}
        ms = []
        for seed in range(args.seeds):
            instance = make_instance(D, M, P, S, seed)
            for name in ALGORITHMS:
                result = plan_instance(instance, name, seed)
                row[name].append(evaluate(instance, np.array(result["plan"]))["ratio_to_bound"])
                if name == "ours":
                    ms.append(result["meta"]["time_s"] * 1000)
                if args.json:
                    dump.append({"instance": instance.to_json(), "plan": result})
            ours_not_worse += row["ours"][-1] <= row["paper"][-1] + 1e-12
        for name in ALGORITHMS:
            ratios[name].extend(row[name])
        if D * M * S == 1024:
            ours_ms_1024.extend(ms)
        print(f"{D:>4} {M:>3} {P:>2} {S:>2} {D * M * S:>6} | "
              + " ".join(f"{np.mean(row[a]):8.3f}" for a in ALGORITHMS) + f" | {np.mean(ms):7.1f}", flush=True)
    total = len(dims) * args.seeds
    print("mean ratio to the lower bound: " + ", ".join(f"{a} {np.mean(ratios[a]):.3f}" for a in ALGORITHMS))
    print(f"ours <= paper on {ours_not_worse} of {total} instances; planning a 1024-sequence batch: "
          f"{np.mean(ours_ms_1024):.1f} ms mean, {np.max(ours_ms_1024):.1f} ms max" if ours_ms_1024 else "")
    if args.json:
        args.json.write_text(json.dumps(dump))
    return 0


if __name__ == "__main__":
    sys.exit(main())
