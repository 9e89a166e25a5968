"""Reordering algorithms side by side on LAION-like cost instances, judged against references that
share no code with them.

    python bench/reorder.py [--seeds 1] [--exact-seeds 3] [--quick] [--deep] [--search-s 20] [--jobs 1]
                            [--json FILE] [--plot FILE.png]

1. Exact optima (small instances: D in {2, 3}, M <= 4, S <= 2, B <= 12, P in {4, 8}): every planner's
   gap to the optimum found by exhaustive search (reference_planner.exact_optimum).
2. Larger instances (D ranks in {8, 32, 64}, M microbatches in {8, 32}, P stages in {4, 8}, S sequences
   per microbatch in {1, 2, 4}): every planner's gap to an independent ``--search-s``-second search
   (reference_search.search: its own simulator, a vector-LPT start, random restarts, swaps across
   ranks and slots under a smooth objective; a negative gap means the planner found the faster plan);
   the default planner's gap to the same-kernel search (search_reference: ours' own moves, from the best
   planner's plan, for as long: what more time buys, not how far the best plan is); ratios to the batch
   lower bound; the default planner's warm CPU time (its second call on the instance, one thread).
3. The JIT's cost apart (first call in a fresh process, compiling into an empty numba cache and
   loading from it), and a table with shared replicas (coupled objective; not in --quick).

``--quick`` runs tiny instances with 0.5 s searches (seconds); ``--json FILE`` writes the tables
(bench/benchjson.py) and, under "instances", every instance with every planner's plan in the
disttrain-reorder-instance/1 and -plan/1 forms; ``--plot`` draws one rank's 1F1B
timeline under ``paper`` and ``ours`` and the per-rank makespan spread; ``--deep`` adds ``ours-deep``
(100 times ours' budget). The searches run in ``--jobs`` processes (default 1: a shared machine).

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
* stage maps: P=4 ["enc", "bb/2", "bb/2", "gen"]; P=8 ["enc", "bb/6" x 6, "gen"];
* independent ranks (every rank has its own encoder and generator) for the main table; a second
  table has shared replicas (one encoder per 4 backbone ranks, one generator per 8, each with as
  many GPUs as the ranks it serves: 1/g of the time per sequence) and the coupled objective.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: benchjson, reference_*

import benchjson
import reference_planner as reference
import reference_search

from disttrain_api.config import JobConfig, field_defaults
from disttrain_api.layout import StageModel
from preprocess_service.core import simkernels
from preprocess_service.core.reorder import warm_up
from preprocess_service.core.reorder.instance import (
    PLAN_FORMAT,
    PLANNERS,
    Instance,
    check_plan,
    evaluate,
    plan_instance,
)
from preprocess_service.core.simulate import topological_order

STAGE_MAPS = {4: ("enc", "bb/2", "bb/2", "gen"), 8: ("enc", *["bb/6"] * 6, "gen")}
DEFAULT = field_defaults(JobConfig)["reorder_algorithm"]
"""The service's planner (JobConfig's default), the one the bench times and checks against paper."""
ALGORITHMS = ("random", "arrival", "paper", "lpt", "ours")
"""Planners side by side; the default (DEFAULT) is added when not among them."""
PLOT_CONFIG = (8, 8, 4, 2)  # D, M, P, S of the instance --plot draws (seed 0)


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


def make_instance(D: int, M: int, P: int, S: int, seed: int, shared_by: tuple[int, int, int] = (1, 1, 1)) -> Instance:
    rng = np.random.default_rng([D, M, P, S, seed])
    model = StageModel(stage_map=STAGE_MAPS[P], bwd_factor=(2.0, 2.0, 2.0), p2p_latency=1e-4, shared_by=shared_by)
    # a shared replica has as many GPUs as the ranks it serves: 1/g of the time per sequence
    costs = sequence_costs(D * M * S, rng) / np.asarray(shared_by, dtype=float)
    return Instance(D=D, M=M, S=S, model=model, costs=costs)


COUPLED_CONFIGS = [(D, M, 4, 2, (4, 1, 8)) for D in (8, 32) for M in (8, 32)]
"""Disaggregated encoder and generator with fewer replicas than backbone ranks: D, M, P, S and
shared_by (one encoder replica per 4 backbone ranks, one generator replica per 8)."""


def coupled_table(seeds: int, dump: list | None) -> list[float]:
    """Ratios to the bound under the coupled objective, and the default planner run as if ranks
    were independent (``indep``: what planning for the wrong objective costs)."""
    names = tuple(dict.fromkeys(ALGORITHMS + (DEFAULT,))) + ("indep",)
    print("\nshared replicas (enc shared by 4 ranks, gen by 8; coupled objective):")
    print(f"{'D':>4} {'M':>3} {'P':>2} {'S':>2} {'B':>6} | " + " ".join(f"{a:>10}" for a in names) + f" | {DEFAULT} ms")
    ours_ratios = []
    for D, M, P, S, shared in COUPLED_CONFIGS:
        row, ms = {a: [] for a in names}, []
        for seed in range(seeds):
            instance = make_instance(D, M, P, S, seed, shared)
            independent = Instance(D=D, M=M, S=S, model=StageModel(stage_map=instance.model.stage_map,
                                                                     bwd_factor=instance.model.bwd_factor,
                                                                     p2p_latency=instance.model.p2p_latency),
                                   costs=instance.costs)
            for name in names:
                plan, cpu = timed_plan(independent if name == "indep" else instance,
                                       DEFAULT if name == "indep" else name, seed)
                row[name].append(evaluate(instance, plan)["ratio_to_bound"])
                if name == DEFAULT:
                    ms.append(cpu * 1000)
                if dump is not None and name != "indep":
                    dump.append({"instance": instance.to_json(), "plan": {"plan": plan.tolist(), "meta": {
                        "method": name, "time_s": cpu}}})
        ours_ratios.extend(row[DEFAULT])
        print(f"{D:>4} {M:>3} {P:>2} {S:>2} {D * M * S:>6} | " + " ".join(f"{np.mean(row[a]):10.3f}" for a in names)
              + f" | {np.mean(ms):7.1f}", flush=True)
    return ours_ratios


def search_reference(args: tuple) -> float:
    """The reference a planner's gap is measured against: a time-boxed local search with the exact
    simulator (bench only, so boxed by the thread's CPU time, not ops). From the best plan of all planners:
    the planner's local search (simkernels.local_search) to a local optimum, then iterated local
    search until ``seconds`` are up: perturb the best plan by random sequence swaps between random
    ranks (2% of the batch), search to a local optimum again, keep it when it is no slower.
    Returns the best iteration time found (never above the start's)."""
    D, M, P, S, seed, shared, start, seconds = args
    instance = make_instance(D, M, P, S, seed, shared)
    model = instance.model
    seq_fwd, seq_bwd = (np.ascontiguousarray(a) for a in model.stage_times(instance.costs))
    L, groups, latency = model.component, model.kernel_groups(), float(model.p2p_latency)
    order = topological_order(model.num_stages, M)

    def times(plan: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return (np.ascontiguousarray(seq_fwd[:, plan].sum(axis=-1).transpose(1, 0, 2)),
                np.ascontiguousarray(seq_bwd[:, plan].sum(axis=-1).transpose(1, 0, 2)))

    def span(plan: np.ndarray) -> float:
        return float(simkernels.component_spans(*times(plan), L, groups, *order, latency).max())

    rng = np.random.default_rng([seed, 0x5EA])
    best = np.ascontiguousarray(start, dtype=np.int64)
    best_s = span(best)
    patience = 4 * (M * M + 9 * (M * S) ** 2)
    deadline = time.thread_time() + seconds
    plan = best.copy()
    while time.thread_time() < deadline:
        simkernels.local_search(plan, seq_fwd, seq_bwd, *times(plan), L, groups, *order, latency,
                                int(rng.integers(2**31 - 1)), 200_000, patience)
        spent = span(plan)
        if spent <= best_s:
            best, best_s = plan.copy(), spent
        flat = best.copy().reshape(D, M * S)
        for _ in range(max(1, D * M * S // 50)):
            a, b = rng.integers(D, size=2)
            i, j = rng.integers(M * S, size=2)
            flat[a, i], flat[b, j] = flat[b, j], flat[a, i]
        plan = np.ascontiguousarray(flat.reshape(D, M, S))
    return best_s


def jit_seconds() -> dict:
    """Seconds of the planner's first call in a fresh process (reorder.warm_up): compiling the numba
    kernels into an empty cache, and loading them from the on-disk cache (what a service does)."""
    code = ("import time; t = time.perf_counter(); from preprocess_service.core import reorder; "
            "reorder.warm_up(); print(time.perf_counter() - t)")
    root = Path(__file__).resolve().parent.parent
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        for name, env in (("compile", {"NUMBA_CACHE_DIR": cache}), ("cached", {"NUMBA_CACHE_DIR": cache})):
            run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                                 env=os.environ | env, check=True)
            out[name] = float(run.stdout.split()[-1])
    return out


def timed_plan(instance: Instance, name: str, seed: int) -> tuple[np.ndarray, float]:
    """A planner's plan and its CPU seconds (one thread: figures for one core on a shared machine)."""
    start = time.thread_time()
    plan = PLANNERS[name](instance, np.random.default_rng(seed))
    return check_plan(instance, plan), time.thread_time() - start


EXACT_CONFIGS = [(D, M, P, S) for D, M, S in ((2, 2, 1), (2, 3, 1), (2, 4, 1), (2, 2, 2), (2, 3, 2), (3, 2, 1),
                                                 (3, 3, 1), (3, 4, 1), (3, 2, 2)) for P in (4, 8)]
"""D, M, P, S of the instances solved exactly (B <= 12, M <= 4: reference_planner.exact_optimum)."""
QUICK_EXACT = [(2, 2, 4, 1), (2, 2, 8, 2), (3, 2, 4, 1)]
QUICK_DIMS = [(4, 4, 4, 1), (4, 8, 8, 2)]


def _gap(seconds: float, reference_s: float) -> float:
    """seconds / reference_s - 1, with differences of rounding (1e-9 relative) as 0."""
    gap = seconds / reference_s - 1
    return 0.0 if abs(gap) < 1e-9 else gap


def gap_stats(gaps: list[float]) -> str:
    return f"mean {100 * np.mean(gaps):+6.2f}%, max {100 * np.max(gaps):+6.2f}%"


def exact_rows(configs: list[tuple[int, int, int, int]], seeds: int, algorithms: tuple[str, ...]) -> list[dict]:
    """Every planner's iteration time against the exact optimum (an independent exhaustive search)."""
    rows = []
    for D, M, P, S in configs:
        for seed in range(seeds):
            instance = make_instance(D, M, P, S, seed)
            optimum, _ = reference.exact_optimum(reference.load_instance(instance.to_json()))
            gaps = {a: _gap(evaluate(instance, timed_plan(instance, a, seed)[0])["iteration_s"], optimum)
                    for a in algorithms}
            rows.append({"dims": (D, M, P, S), "seed": seed, "optimum_s": optimum, "gap": gaps})
    return rows


def run_search(task: tuple) -> float:
    """One reference search (in a worker process): ``("independent", instance JSON, seconds, seed)``
    or ``("same-kernel", search_reference's arguments...)``."""
    if task[0] == "independent":
        _, data, seconds, seed = task
        return reference_search.search(reference.load_instance(data), seconds, seed)[0]
    return search_reference(task[1:])


def planned_rows(dims: list[tuple[int, int, int, int]], seeds: int, algorithms: tuple[str, ...]) -> list[dict]:
    """Every planner's plan per instance, its iteration time and ratio to the lower bound, and the
    default planner's warm CPU time (its second call on the instance: one thread)."""
    rows = []
    for D, M, P, S in dims:
        for seed in range(seeds):
            instance = make_instance(D, M, P, S, seed)
            row: dict = {"dims": (D, M, P, S), "seed": seed, "instance": instance, "s": {}, "ratio": {},
                         "plans": {}, "cpu_s": {}}
            for name in algorithms:
                plan, row["cpu_s"][name] = timed_plan(instance, name, seed)
                figures = evaluate(instance, plan)
                row["s"][name], row["ratio"][name] = figures["iteration_s"], figures["ratio_to_bound"]
                row["plans"][name] = plan
                row["bound_s"] = figures["lower_bound_s"]
            again, row["warm_s"] = timed_plan(instance, DEFAULT, seed)
            assert np.array_equal(again, row["plans"][DEFAULT]), "the default planner is not deterministic"
            rows.append(row)
    return rows


def searches(rows: list[dict], seconds: float, jobs: int) -> None:
    """Adds each row's independent search result and same-kernel search result (row["independent_s"],
    row["same_kernel_s"]), ``seconds`` of CPU time each, in ``jobs`` processes."""
    tasks = []
    for r in rows:
        start = min(r["plans"].items(), key=lambda kv: r["s"][kv[0]])[1]
        tasks.append(("independent", r["instance"].to_json(), seconds, r["seed"]))
        tasks.append(("same-kernel", *r["dims"], r["seed"], (1, 1, 1), start, seconds))
    print(f"references: {seconds:g} s independent search and {seconds:g} s same-kernel search per instance, "
          f"{len(rows)} instances on {jobs} process(es) ...", flush=True)
    if jobs > 1:
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            results = pool.map(run_search, tasks)
    else:
        results = [run_search(t) for t in tasks]
    for i, r in enumerate(rows):
        r["independent_s"], r["same_kernel_s"] = results[2 * i], min(results[2 * i + 1], *r["s"].values())


def size_class(dims: tuple[int, int, int, int]) -> str:
    B = dims[0] * dims[1] * dims[3]
    return "B <= 256" if B <= 256 else "B 257..2048" if B <= 2048 else "B > 2048"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--exact-seeds", type=int, default=3, help="seeds per exactly solved configuration")
    parser.add_argument("--quick", action="store_true", help="tiny instances and 0.5 s searches (a few seconds)")
    parser.add_argument("--deep", action="store_true", help="also run ours-deep (100 times ours' budget)")
    parser.add_argument("--search-s", type=float, default=None,
                        help="CPU seconds of each reference search per instance (default 20, --quick 0.5)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32, 64], help="values of D (default 8 32 64)")
    parser.add_argument("--jobs", type=int, default=1, help="processes for the reference searches (default 1)")
    parser.add_argument("--json", type=Path, help="write the tables (and every instance and plan) here")
    parser.add_argument("--plot", type=Path, help="draw a 1F1B timeline before/after and the rank spread (PNG)")
    args = parser.parse_args(argv)
    seconds = args.search_s if args.search_s is not None else 0.5 if args.quick else 20.0
    algorithms = tuple(dict.fromkeys(ALGORITHMS + (DEFAULT,) + (("ours-deep",) if args.deep else ())))
    dims = QUICK_DIMS if args.quick else list(itertools.product(args.ranks, (8, 32), (4, 8), (1, 2, 4)))
    doc = benchjson.document("reorder", quick=args.quick, argv=None if argv is None else ["bench/reorder.py", *argv])
    jit = None if args.quick else jit_seconds()
    warm_up()
    if args.quick:  # its 0.5 s searches would be spent compiling on a cold numba cache
        reference_search.warm_up()

    exact = exact_rows(QUICK_EXACT if args.quick else EXACT_CONFIGS, 1 if args.quick else args.exact_seeds,
                       algorithms)
    doc["tables"].append(print_exact(exact, algorithms))
    rows = planned_rows(dims, args.seeds, algorithms)
    searches(rows, seconds, args.jobs)
    doc["tables"].extend(print_searched(rows, algorithms, seconds))
    notes = []
    if jit is not None:
        notes.append(f"JIT of the planner's kernels (first call in a fresh process): {jit['compile']:.2f} s compiling, "
                     f"{jit['cached']:.2f} s loading numba's on-disk cache (the service does this at start)")
        print(notes[-1])
        coupled = coupled_table(args.seeds, None)
        print(f"shared replicas: {DEFAULT} mean ratio {np.mean(coupled):.3f}, max {np.max(coupled):.3f}")
        notes.append(f"shared replicas (coupled objective, {len(coupled)} instances): {DEFAULT} ratio to the lower "
                     f"bound mean {np.mean(coupled):.3f}, max {np.max(coupled):.3f}")
    doc["tables"][-1]["notes"].extend(notes)
    if args.json:
        doc["instances"] = [{"instance": r["instance"].to_json(),
                             "plans": {a: {"format": PLAN_FORMAT, "plan": p.tolist(), "meta": {"method": a}}
                                       for a, p in r["plans"].items()},
                             "independent_s": r["independent_s"], "same_kernel_s": r["same_kernel_s"]} for r in rows]
        benchjson.write(args.json, doc)
        print(f"wrote {args.json}")
    if args.plot:
        plot(args.plot)
        print(f"wrote {args.plot}")
    return 0


def print_exact(rows: list[dict], algorithms: tuple[str, ...]) -> dict:
    print(f"gap to the exact optimum ({len(rows)} small instances, exhaustive search sharing no code with the "
          "planners; %, mean over seeds):")
    configs = list(dict.fromkeys(r["dims"] for r in rows))
    print(f"{'D':>4} {'M':>3} {'P':>2} {'S':>2} {'B':>6} | " + " ".join(f"{a:>9}" for a in algorithms))
    table_rows = []
    for dims in configs:
        sel = [r for r in rows if r["dims"] == dims]
        D, M, P, S = dims
        gaps = [round(100 * float(np.mean([r["gap"][a] for r in sel])), 3) for a in algorithms]
        table_rows.append([D, M, P, S, D * M * S, *gaps])
        print(f"{D:>4} {M:>3} {P:>2} {S:>2} {D * M * S:>6} | " + " ".join(f"{g:9.2f}" for g in gaps))
    notes = []
    for a in algorithms:
        notes.append(f"{a}: gap to the optimum {gap_stats([r['gap'][a] for r in rows])}")
        print("  " + notes[-1])
    return benchjson.table("gap to the exact optimum (%), small instances",
                           ["D", "M", "P", "S", "B", *algorithms], table_rows, notes=notes)


def print_searched(rows: list[dict], algorithms: tuple[str, ...], seconds: float) -> list[dict]:
    print(f"\ngap to an independent {seconds:g}-second search (vector-LPT start, random restarts, smooth objective, "
          "swaps across ranks and slots; its own simulator) per instance (%, mean over seeds; negative: the "
          f"planner is faster); {DEFAULT} against the same-kernel {seconds:g}-second search (its own moves from the "
          f"best planner's plan); ratios to the lower bound; {DEFAULT}'s warm CPU ms per batch:")
    head = [*algorithms, "same-kernel", f"{DEFAULT}/bound", "indep/bound", "ms/batch"]
    print(f"{'D':>4} {'M':>3} {'P':>2} {'S':>2} {'B':>6} | " + " ".join(f"{a:>11}" for a in head))
    table_rows = []
    for r in rows:
        r["gap"] = {a: _gap(r["s"][a], r["independent_s"]) for a in algorithms}
        r["same_gap"] = _gap(r["s"][DEFAULT], r["same_kernel_s"])
        r["ms_1024"] = 1000 * r["warm_s"] * 1024 / (r["dims"][0] * r["dims"][1] * r["dims"][3])
    for dims in dict.fromkeys(r["dims"] for r in rows):
        sel = [r for r in rows if r["dims"] == dims]
        D, M, P, S = dims
        cells = [100 * np.mean([r["gap"][a] for r in sel]) for a in algorithms]
        cells += [100 * np.mean([r["same_gap"] for r in sel]), np.mean([r["ratio"][DEFAULT] for r in sel]),
                  np.mean([r["independent_s"] / r["bound_s"] for r in sel]), 1000 * np.mean([r["warm_s"] for r in sel])]
        table_rows.append([D, M, P, S, D * M * S, *[round(float(c), 4) for c in cells]])
        print(f"{D:>4} {M:>3} {P:>2} {S:>2} {D * M * S:>6} | " + " ".join(f"{c:11.3f}" for c in cells))
    notes = [f"{len(rows)} instances; gap of each planner to the independent search: " + "; ".join(
        f"{a} {gap_stats([r['gap'][a] for r in rows])}" for a in algorithms)]
    for cls in ("B <= 256", "B 257..2048", "B > 2048"):
        sel = [r for r in rows if size_class(r["dims"]) == cls]
        if sel:
            notes.append(f"{DEFAULT} vs the independent search, {cls} ({len(sel)} instances): "
                         f"{gap_stats([r['gap'][DEFAULT] for r in sel])}")
    notes.append(f"{DEFAULT} vs the same-kernel search (same moves, more time): "
                 f"{gap_stats([r['same_gap'] for r in rows])}")
    notes.append(f"ratio to the lower bound: {DEFAULT} mean {np.mean([r['ratio'][DEFAULT] for r in rows]):.4f}, "
                 f"max {np.max([r['ratio'][DEFAULT] for r in rows]):.4f}; independent search mean "
                 f"{np.mean([r['independent_s'] / r['bound_s'] for r in rows]):.4f}")
    large = [r["ms_1024"] for r in rows if r["dims"][0] * r["dims"][1] * r["dims"][3] >= 1024]
    if large:  # smaller batches get a minimum budget (ours.SEARCH_OPS), so per-1024 figures would mislead
        notes.append(f"{DEFAULT}'s warm CPU ms per 1024 sequences (second call, one thread; batches of >= 1024 "
                     f"sequences): mean {np.mean(large):.1f}, max {np.max(large):.1f}")
    not_worse = sum(r["s"][DEFAULT] <= r["s"]["paper"] * (1 + 1e-12) for r in rows)
    notes.append(f"{DEFAULT} <= paper on {not_worse} of {len(rows)} instances")
    for n in notes:
        print("  " + n)
    return [benchjson.table(f"gap to an independent {seconds:g}-second search (%), and {DEFAULT} against the "
                            f"same-kernel search", ["D", "M", "P", "S", "B", *head], table_rows, notes=notes)]


def plot(path: Path) -> None:
    """One rank's 1F1B timeline under paper (before) and ours (after), both for the rank that is
    slowest under that plan, and every algorithm's per-rank makespans relative to the lower bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from preprocess_service.core.simulate import simulate_1f1b

    instance = make_instance(*PLOT_CONFIG, seed=0)
    D, M, P, S = PLOT_CONFIG
    seq_fwd, seq_bwd = instance.model.stage_times(instance.costs)
    fig, axes = plt.subplots(3, 1, figsize=(11, 8.5), gridspec_kw={"height_ratios": [1, 1, 1.1]})
    spreads = {}
    horizon = 0.0
    timelines = {}
    for name in ALGORITHMS:
        plan = np.array(plan_instance(instance, name, 0)["plan"])
        fwd = seq_fwd[:, plan].sum(axis=-1).transpose(1, 0, 2)
        bwd = seq_bwd[:, plan].sum(axis=-1).transpose(1, 0, 2)
        spans = np.array([simulate_1f1b(fwd[r], bwd[r], instance.model.p2p_latency).makespan for r in range(D)])
        spreads[name] = spans
        if name in ("paper", "ours"):
            slow = int(np.argmax(spans))
            timelines[name] = (slow, simulate_1f1b(fwd[slow], bwd[slow], instance.model.p2p_latency))
            horizon = max(horizon, spans.max())
    bound = evaluate(instance, np.array(plan_instance(instance, "ours", 0)["plan"]))["lower_bound_s"]
    colors = plt.get_cmap("tab10")
    for ax, name in zip(axes[:2], ("paper", "ours")):
        slow, t = timelines[name]
        for s in range(P):
            for m in range(M):
                ax.barh(s, t.f_end[s, m] - t.f_start[s, m], left=t.f_start[s, m], color=colors(m % 10),
                        edgecolor="black", linewidth=0.3)
                ax.barh(s, t.b_end[s, m] - t.b_start[s, m], left=t.b_start[s, m], color=colors(m % 10),
                        edgecolor="black", linewidth=0.3, hatch="//", alpha=0.75)
        ax.axvline(bound, color="red", linestyle="--", linewidth=1)
        ax.set_yticks(range(P), [f"{s}: {instance.model.stage_map[s]}" for s in range(P)])
        ax.invert_yaxis()
        ax.set_xlim(0, horizon * 1.02)
        ax.set_title(f"{name}: slowest rank ({slow}), makespan {t.makespan:.3f} s = "
                     f"{t.makespan / bound:.3f} x lower bound (red); colour = microbatch, hatched = backward",
                     fontsize=9)
    axes[1].set_xlabel("seconds")
    ax = axes[2]
    ax.boxplot([spreads[a] / bound for a in ALGORITHMS], tick_labels=list(ALGORITHMS), whis=(0, 100))
    for i, a in enumerate(ALGORITHMS, start=1):
        ax.scatter(np.full(D, i), spreads[a] / bound, s=10, color="black", zorder=3)
    ax.axhline(1.0, color="red", linestyle="--", linewidth=1)
    ax.set_ylabel("rank makespan / lower bound")
    ax.set_title(f"per-rank 1F1B makespans (D={D}, M={M}, P={P}, S={S}); the iteration waits for the highest",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
