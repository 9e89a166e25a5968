"""Measured training steps where data heterogeneity dominates: reordering off, the paper's and ours,
on the planner's best monolithic and best disaggregated layout, each beside the simulator's
prediction.

    python bench/train.py [--procs N] [--rounds 3] [--steps 4] [--global-batch 8] [--seqs-per-microbatch 1,2,4]
                          [--json FILE]
    python bench/train.py --quick          # smoke run (the test's): tiny data, model and sequences, 2 runs

How the setup makes heterogeneity, not CPU contention, decide the step time:

* **One process per core** (``--procs``, default: this machine's cores), one thread each. A rank
  that waits is a core that idles, so bubbles and stragglers show in the step time. (With more
  processes than cores the OS fills one rank's wait with another's work, and every layout
  measures the same total CPU work: the flaw of this bench's first version.) The machine must be
  otherwise idle for the measured times to mean anything; the predicted ones do not depend on it.
* **Data** (``MIX``, synthetic img2dataset shards in ``data/bench-train/``): LAION-style
  image-caption pairs (45%; 10% of them with 2-8 images), text-only documents (30%, median 150
  words), OBELICS-style interleaved documents (10%, 2-5 texts, 1-4 images), text-to-image samples
  (10%) and audio samples (5%); image sizes LAION-like (``synth._draw_size``). Packed into
  2048-token sequences, some without media and some nearly all encoder tokens (the run prints
  the spread: encoder tokens per sequence and seconds per sequence, percentiles).
* **Model**: the trainer's small multimodal model with ``LAYERS`` backbone blocks, so that on
  average the encoder and the backbone cost about the same per microbatch, while one microbatch's
  encoder time ranges from nothing to several times the mean.
* **Costs**: measured once (``trainer.orchestration.measure`` on probe jobs) by ``--procs``
  processes at once, so with every core busy as in the runs (a core measured alone is faster),
  and written to a file that every run opens its job with (``--costs``): the
  service prices every sequence in this machine's seconds, and every run plans with the same
  prices.
* **The service** runs in this process and prepares up to ``PREFETCH`` microbatches ahead per
  stream, i.e. a run's whole data during its 2 warm-up steps, so it takes no core from the
  measured steps (on a cluster it has CPU nodes of its own).
* **Layouts**: for each ``--seqs-per-microbatch`` S (sequences per rank per microbatch; the
  global batch stays ``--global-batch`` sequences, so M = global batch / (DP x S)), the
  orchestration planner's fastest monolithic and fastest (partly) disaggregated layout of exactly
  ``--procs`` processes (``search_exact``). At S = 1 each rank holds one sequence per microbatch
  slot, where the paper's intra-microbatch step can balance only through the loads it carries
  across slots (``reorder.intra_paper``).
* **Runs**: every S x layout x reordering (``arrival``: none; ``paper``; ``ours``) is one torchrun of
  ``--steps`` + 2 warm-up steps. Each round runs every configuration, in an order rotated per
  round, all on one data seed, so step k trains the same sequences in every configuration; the
  next round takes the next seed. Medians over all measured steps of all rounds; the paired ratio
  is the median over (round, step) of a configuration's step time / arrival's on the same layout.
* **Prediction**: for each step, the service's exact 1F1B simulator's iteration time of the plan
  it served (``JobReport.step_balance[].iteration_s``, in the measured costs) and its idle share;
  error = median predicted / median measured - 1. The simulator counts compute only: the gradient
  all-reduce, the optimizer step, activation copies and Python overhead are what the error holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))  # benchjson, also when a test loads this file by path
sys.path.insert(0, str(REPO))

import benchjson  # noqa: E402
import grpc  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from disttrain_api import preprocess_pb2 as pb  # noqa: E402
from disttrain_api import preprocess_pb2_grpc as pb_grpc  # noqa: E402
from disttrain_tools import synth  # noqa: E402
from preprocess_service.service.server import create_server  # noqa: E402
from trainer import DataClient  # noqa: E402
from trainer.models.backbone import spans_index  # noqa: E402
from trainer.orchestration.measure import Measured, measure_concurrently  # noqa: E402
from trainer.orchestration.planner import Plan, search_exact  # noqa: E402
from trainer.train import job_config, parse  # noqa: E402

LAYERS = 8
SEQ_LEN = 2048
WARMUP = 2
QUICK = {"rounds": 1, "steps": 1, "global_batch": 4, "layers": 1, "seq_len": 512, "warmup": 1, "probes": 2,
         "spread": 8}
"""--quick: one step after one warm-up step of a one-block model on 512-token sequences."""
REORDERS = ("arrival", "paper", "ours")
PREFETCH = 64
"""Microbatches the service prepares ahead per stream: more than one run's (steps + 2) x M."""
DATA = REPO / "data" / "bench-train"
QUICK_DATA = REPO / "data" / "bench-train-quick"
"""--quick's smaller dataset: apart, so that a quick run never rewrites the full one."""
MIX = {"text_share": 0.30, "interleaved_share": 0.10, "generate_share": 0.10, "audio_share": 0.05}
"""Sample kinds besides the image-caption pairs (the rest, 45%)."""


def dataset(path: Path = DATA, shards: int = 4, samples_per_shard: int = 250) -> Path:
    synth.ensure_dataset(path, synth.SynthConfig(num_shards=shards, samples_per_shard=samples_per_shard, seed=1,
                                                 **MIX))
    return path


def base_argv(address: str, shards: Path, layers: int, seq_len: int) -> list[str]:
    return ["--address", address, "--shards", str(shards), "--seq-len", str(seq_len), "--model-layers", str(layers)]


def data_spread(address: str, argv: list[str], measured: Measured, sequences: int = 48) -> dict:
    """Per-sequence encoder tokens and forward + backward seconds (the service's price in the
    measured costs) of the job's arrival stream: how heterogeneous the work is."""
    args = parse(argv + ["--seed", "4242", "--reorder", "arrival", "--num-microbatches", "1"])
    enc, total = [], []
    with DataClient(address, job_config(args, measured.cost_config()), 0, prefetch=2) as client:
        for _ in range(sequences):
            mb = next(client)
            enc.append(len(spans_index(mb.image_spans)) + len(spans_index(mb.audio_spans)))
            total.extend(mb.sequence_costs)
        client.close_job()
    q = [0, 10, 50, 90, 100]
    return {"encoder_tokens_percentiles": dict(zip(q, np.percentile(enc, q).round().tolist())),
            "no_image_share": float(np.mean(np.array(enc) == 0)),
            "sequence_s_percentiles": dict(zip(q, np.percentile(total, q).round(3).tolist()))}


def layout_argv(plan: Plan) -> list[str]:
    layout = plan.layout()
    return ["--enc-dp", str(layout.enc_dp), "--bb-dp", str(layout.bb_dp), "--bb-pp", str(layout.bb_pp),
            "--gen-dp", str(layout.gen_dp), "--num-microbatches", str(plan.num_microbatches)]


@dataclass
class Config:
    name: str
    plan: Plan
    reorder: str
    seqs_per_microbatch: int = 1
    measured: list[float] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)
    bubble: list[float] = field(default_factory=list)
    predicted_bubble: list[float] = field(default_factory=list)
    by_step: dict = field(default_factory=dict)
    """(round, step) -> measured seconds"""


def run(config: Config, address: str, argv: list[str], costs: Path, seed: int, steps: int, workdir: Path,
        round_: int, warmup: int = WARMUP) -> None:
    """One torchrun; appends its measured and predicted steps to ``config``."""
    log = workdir / f"{config.name.replace(' ', '_')}-S{config.seqs_per_microbatch}-{config.reorder}-{round_}.jsonl"
    log.unlink(missing_ok=True)
    train = argv + layout_argv(config.plan) + ["--seqs-per-microbatch", str(config.seqs_per_microbatch), "--reorder",
                                               config.reorder, "--seed", str(seed), "--costs", str(costs)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(config.plan.gpus), "-m", "trainer.train", *train, "--steps", str(steps + warmup),
           "--log-json", str(log)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in log.read_text().splitlines()][warmup:]
    job_id = job_config(parse(train), Measured.load(costs).cost_config()).job_id()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.PreprocessStub(channel)
        report = stub.GetReport(pb.ReportRequest(job_id=job_id), timeout=30)
        stub.CloseJob(pb.CloseJobRequest(job_id=job_id), timeout=30)  # a client may hold only so many open jobs
    balance = {b.step: b for b in report.step_balance}
    for r in records:
        step = balance.get(r["step"])
        if step is None:
            raise SystemExit(f"job {job_id} has no plan of step {r['step']} in its report")
        config.measured.append(r["step_s"])
        config.bubble.append(r["bubble_mean"])
        config.predicted.append(step.iteration_s)
        config.predicted_bubble.append(step.bubble_fraction)
        config.by_step[(round_, r["step"])] = r["step_s"]


def paired_ratio(config: Config, base: Config) -> float:
    keys = sorted(set(config.by_step) & set(base.by_step))
    return statistics.median(config.by_step[k] / base.by_step[k] for k in keys) if keys else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, default=os.cpu_count() or 2,
                        help="trainer processes (default: one per core)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="measured steps per run (after 2 warm-up steps)")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step (= DP x microbatches x S)")
    parser.add_argument("--seqs-per-microbatch", default="1",
                        help="S, sequences per rank per microbatch: one set of runs per value, e.g. 1,2,4 "
                             "(default 1)")
    parser.add_argument("--layers", type=int, default=LAYERS, help="backbone blocks")
    parser.add_argument("--seed", type=int, default=0, help="data seed of round 0 (round r: seed + r)")
    parser.add_argument("--data", type=Path, help=f"dataset folder (default {DATA.relative_to(REPO)}; --quick: "
                                                   f"{QUICK_DATA.relative_to(REPO)})")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 1 round of 1 step, a 1-block model, 512-token sequences, 4 sequences, "
                             "monolithic, arrival and ours")
    args = parser.parse_args(argv)
    seq_len, warmup, probes, spread_n = SEQ_LEN, WARMUP, 6, 48
    if args.quick:
        args.rounds, args.steps, args.global_batch, args.layers = (QUICK[k] for k in ("rounds", "steps", "global_batch",
                                                                                      "layers"))
        seq_len, warmup, probes, spread_n = (QUICK[k] for k in ("seq_len", "warmup", "probes", "spread"))
    per_microbatch = [int(v) for v in args.seqs_per_microbatch.split(",")]
    if any(S < 1 or args.global_batch % S for S in per_microbatch):
        parser.error(f"every --seqs-per-microbatch must be >= 1 and divide --global-batch {args.global_batch}, "
                     f"got {per_microbatch}")
    cores = os.cpu_count() or 1
    if args.procs > cores:
        print(f"warning: {args.procs} processes on {cores} cores: contention, not the pipeline, sets the step time")
    shards = dataset(args.data or (QUICK_DATA if args.quick else DATA), *((1, 60) if args.quick else (4, 250)))
    torch.set_num_threads(1)
    started = time.perf_counter()
    probe_server, probe_port, _ = create_server("127.0.0.1:0", decode_workers=0)  # 2 ahead: decodes little
    try:
        probe_argv = base_argv(f"127.0.0.1:{probe_port}", shards, args.layers, seq_len)
        seeds = [args.seed + 101 * i for i in range(args.procs)]  # one probe per process, all at once
        measured = measure_concurrently(probe_argv[1], [job_config(parse(probe_argv + ["--seed", str(s)]))
                                                        for s in seeds], args.layers, microbatches=probes)
        spread = data_spread(probe_argv[1], probe_argv, measured, spread_n)
    finally:
        probe_server.stop(0).wait()
    c = measured.content
    print(f"costs measured in {time.perf_counter() - started:.0f} s (forward s; backward = x factor): encoder "
          f"{measured.enc_s_per_token * 1e6:.0f} us/token, backbone {measured.bb_s_per_token * 1e6:.1f} us/token, "
          f"generator {measured.gen_s_per_image * 1e3:.1f} ms/image, backward factors "
          f"{tuple(round(f, 2) for f in measured.bwd_factor)}; mean sequence {c.tokens} tokens, "
          f"{c.image_tokens} encoder tokens, {c.gen_images:.2f} images to generate")
    print(f"data heterogeneity over {seq_len}-token sequences: encoder tokens p0/p10/p50/p90/p100 "
          f"{'/'.join(str(int(v)) for v in spread['encoder_tokens_percentiles'].values())}, "
          f"{spread['no_image_share']:.0%} without media; forward+backward s per sequence "
          f"{'/'.join(f'{v:.2f}' for v in spread['sequence_s_percentiles'].values())}")
    # decode ahead: each stream's whole run is prepared during the warm-up steps, so the service
    # (on a cluster: its own CPU nodes) takes no core from the measured steps
    server, port, _ = create_server("127.0.0.1:0", decode_workers=0, prefetch=PREFETCH)
    address = f"127.0.0.1:{port}"
    workdir = Path(tempfile.mkdtemp(prefix="disttrain-bench-train-"))
    try:
        argv_ = base_argv(address, shards, args.layers, seq_len)
        costs = workdir / "costs.json"
        measured.save(costs)
        configs = []
        for S in per_microbatch:
            problem = problem_at(measured, S, args.procs, args.global_batch, args.layers)
            chosen = search_exact(problem)
            plans = {kind: search_exact(problem, kind) for kind in ("monolithic", "disaggregated")}
            if args.quick:
                plans = {"monolithic": plans["monolithic"]}
            configs += [Config(kind, plan, reorder, S) for kind, plan in plans.items() if plan
                        for reorder in (("arrival", "ours") if args.quick else REORDERS)]
            for kind, plan in plans.items():
                pick = " (the planner's pick)" if plan and chosen and plan.describe() == chosen.describe() else ""
                print(f"S={S} {kind}: {plan.describe() if plan else 'none fits'}{pick}; planner's estimate "
                      f"{plan.iteration_s if plan else float('nan'):.2f} s per step")
        for round_ in range(args.rounds):
            order = configs[round_ % len(configs):] + configs[:round_ % len(configs)]
            for config in order:
                run(config, address, argv_, costs, args.seed + round_, args.steps, workdir, round_, warmup)
            print(f"round {round_ + 1}/{args.rounds} done", flush=True)
        rows = report(configs)
        doc = benchjson.document("train", quick=args.quick, argv=[str(REPO / "bench" / "train.py"), *(
            sys.argv[1:] if argv is None else argv)])
        doc["tables"].append(benchjson.table(
            f"measured training steps on {args.procs} processes and the simulator's prediction", list(TABLE),
            [[row[k] for k in TABLE.values()] for row in rows],
            notes=["vs off: median over (round, step) of the step time / the same step's with no reordering "
                   "(arrival) on the same layout and S; pred.: the same from the simulator's iteration times",
                   "S: sequences per rank per microbatch; the global batch is the same at every S"]))
        benchjson.write(args.json, doc | {"measured": dataclasses.asdict(measured), "data": spread,
                                          "procs": args.procs, "rows": rows})
    finally:
        server.stop(0).wait()
    return 0


def problem_at(measured: Measured, S: int, procs: int, global_batch: int, layers: int):
    """The planner's problem with S sequences per microbatch: the measured mean sequence S times."""
    problem = measured.problem(procs, global_batch, layers)
    c = problem.content
    content = dataclasses.replace(c, tokens=c.tokens * S, image_tokens=c.image_tokens * S, gen_images=c.gen_images * S)
    return dataclasses.replace(problem, content=content, seqs_per_microbatch=S)


TABLE = {"layout": "layout", "S": "seqs_per_microbatch", "reorder": "reorder", "measured s": "measured_s",
         "predicted s": "predicted_s", "error": "error", "busy error": "busy_error", "idle measured": "bubble",
         "idle predicted": "predicted_bubble", "vs off measured": "vs_arrival",
         "vs off predicted": "predicted_vs_arrival", "steps": "steps"}
"""Columns of the JSON table: heading -> row key."""


def report(configs: list[Config]) -> list[dict]:
    """The table: per configuration the median measured and predicted step, the error, the
    error of the busy part alone (compute speed: step x (1 - idle share)), the idle shares, and
    the step time relative to no reordering on the same layout and S (measured: paired by step)."""
    print(f"\n{'layout':56s} {'S':>2s} {'reorder':8s} {'measured':>8s} {'range':>11s} {'predicted':>9s} "
          f"{'error':>6s} {'busy':>6s} {'idle':>5s} {'pred.':>5s} {'vs off':>6s} {'pred.':>6s}")
    base = {(c.plan.describe(), c.seqs_per_microbatch): c for c in configs if c.reorder == "arrival"}
    rows = []
    for c in configs:
        m, p = statistics.median(c.measured), statistics.median(c.predicted)
        busy = statistics.median((pr * (1 - pb)) / (me * (1 - b)) - 1 for pr, pb, me, b
                                 in zip(c.predicted, c.predicted_bubble, c.measured, c.bubble))
        off = base.get((c.plan.describe(), c.seqs_per_microbatch))
        ratio = paired_ratio(c, off) if off else float("nan")
        predicted_ratio = p / statistics.median(off.predicted) if off else float("nan")
        row = {"kind": c.name, "layout": c.plan.describe(), "seqs_per_microbatch": c.seqs_per_microbatch,
               "reorder": c.reorder, "measured_s": m, "measured_min_s": min(c.measured),
               "measured_max_s": max(c.measured), "predicted_s": p, "error": p / m - 1, "busy_error": busy,
               "bubble": statistics.median(c.bubble), "predicted_bubble": statistics.median(c.predicted_bubble),
               "vs_arrival": ratio, "predicted_vs_arrival": predicted_ratio, "steps": len(c.measured)}
        rows.append(row)
        name = f"{c.name}: {c.plan.describe()}"
        print(f"{name[:56]:56s} {c.seqs_per_microbatch:2d} {c.reorder:8s} {m:8.2f} {min(c.measured):5.2f}-"
              f"{max(c.measured):5.2f} {p:9.2f} {row['error']:+6.0%} {busy:+6.0%} {row['bubble']:5.0%} "
              f"{row['predicted_bubble']:5.0%} {ratio:6.2f} {predicted_ratio:6.2f}")
    print()
    for S in dict.fromkeys(r["seqs_per_microbatch"] for r in rows):
        by = {(r["kind"], r["reorder"]): r for r in rows if r["seqs_per_microbatch"] == S}
        for kind in dict.fromkeys(k for k, _ in by):
            if (kind, "paper") in by and (kind, "ours") in by:
                paper, ours = by[(kind, "paper")], by[(kind, "ours")]
                print(f"S={S} {kind}: ours / paper step time measured {ours['measured_s'] / paper['measured_s']:.2f}, "
                      f"predicted {ours['predicted_s'] / paper['predicted_s']:.2f}")
        if ("monolithic", "ours") in by and ("disaggregated", "ours") in by:
            mono, dis = by[("monolithic", "ours")], by[("disaggregated", "ours")]
            print(f"S={S} disaggregated / monolithic step time (ours): measured "
                  f"{dis['measured_s'] / mono['measured_s']:.2f}, "
                  f"predicted {dis['predicted_s'] / mono['predicted_s']:.2f}")
    errors = [abs(r["error"]) for r in rows]
    print(f"prediction error: median {statistics.median(errors):.0%}, max {max(errors):.0%} "
          "(the simulator counts compute only; 'busy' is the error of the compute alone)")
    return rows


if __name__ == "__main__":
    sys.exit(main())
