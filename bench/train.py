"""Measured training steps where data heterogeneity dominates: reordering off, the paper's and ours,
on the planner's best monolithic and best disaggregated layout, each beside the simulator's
prediction.

    python bench/train.py [--procs N] [--rounds 3] [--steps 4] [--global-batch 8] [--json FILE]
    python bench/train.py --quick          # smoke run (the test's): 1 round, 1 step, 2 small runs

How the setup makes heterogeneity, not CPU contention, decide the step time:

* **One process per core** (``--procs``, default: this machine's cores), one thread each. A rank
  that waits is a core that idles, so bubbles and stragglers show in the step time. (With more
  processes than cores the OS fills one rank's wait with another's work, and every layout
  measures the same total CPU work: the flaw of this bench's first version.)
* **Data** (``MIX``, synthetic img2dataset shards in ``data/bench-train/``): LAION-style
  image-caption pairs (45%; 10% of them with 2-8 images), text-only documents (30%, median 150
  words), OBELICS-style interleaved documents (10%, 2-5 texts, 1-4 images), text-to-image samples
  (10%) and audio samples (5%); image sizes LAION-like (``synth._draw_size``). Packed into
  2048-token sequences, a quarter of the sequences hold no image and the rest up to ~1850 encoder
  tokens (the run prints the spread).
* **Model**: the trainer's small multimodal model with ``LAYERS`` backbone blocks, so that on
  average the encoder and the backbone cost about the same per microbatch, while one microbatch's
  encoder time ranges from 0 to about twice the mean.
* **Costs**: measured once (``trainer.orchestration.measure`` on probe jobs) by ``--procs``
  processes at once, so with every core busy as in the runs (measured alone, a core is ~20%
  faster here), and written to a file that every run opens its job with (``--costs``): the
  service prices every sequence in this machine's seconds, and every run plans with the same
  prices.
* **The service** runs in this process and prepares up to ``PREFETCH`` microbatches ahead per
  stream, i.e. a run's whole data during its 2 warm-up steps, so it takes no core from the
  measured steps (on a cluster it has CPU nodes of its own).
* **Layouts**: the orchestration planner's fastest monolithic and fastest (partly) disaggregated
  layout of exactly ``--procs`` processes (``search_exact``).
* **Runs**: every layout x reordering (``arrival``: none; ``paper``; ``ours``) is one torchrun of
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
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from disttrain_api import preprocess_pb2 as pb  # noqa: E402
from disttrain_api import preprocess_pb2_grpc as pb_grpc  # noqa: E402
from preprocess_service.adapters import synth  # noqa: E402
from preprocess_service.service.server import create_server  # noqa: E402
from trainer import DataClient  # noqa: E402
from trainer.models.backbone import spans_index  # noqa: E402
from trainer.orchestration.measure import Measured, measure_concurrently  # noqa: E402
from trainer.orchestration.planner import Plan, search_exact  # noqa: E402
from trainer.train import job_config, parse  # noqa: E402

LAYERS = 8
SEQ_LEN = 2048
WARMUP = 2
REORDERS = ("arrival", "paper", "ours")
PREFETCH = 64
"""Microbatches the service prepares ahead per stream: more than one run's (steps + 2) x M."""
DATA = REPO / "data" / "bench-train"
MIX = {"text_share": 0.30, "interleaved_share": 0.10, "generate_share": 0.10, "audio_share": 0.05}
"""Sample kinds besides the image-caption pairs (the rest, 45%)."""


def dataset(path: Path = DATA, shards: int = 4) -> Path:
    synth.ensure_dataset(path, synth.SynthConfig(num_shards=shards, samples_per_shard=250, seed=1, **MIX))
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
    measured: list[float] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)
    bubble: list[float] = field(default_factory=list)
    predicted_bubble: list[float] = field(default_factory=list)
    by_step: dict = field(default_factory=dict)
    """(round, step) -> measured seconds"""


def run(config: Config, address: str, argv: list[str], costs: Path, seed: int, steps: int, workdir: Path,
        round_: int) -> None:
    """One torchrun; appends its measured and predicted steps to ``config``."""
    log = workdir / f"{config.name.replace(' ', '_')}-{config.reorder}-{round_}.jsonl"
    log.unlink(missing_ok=True)
    train = argv + layout_argv(config.plan) + ["--reorder", config.reorder, "--seed", str(seed), "--costs", str(costs)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(config.plan.gpus), "-m", "trainer.train", *train, "--steps", str(steps + WARMUP),
           "--log-json", str(log)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in log.read_text().splitlines()][WARMUP:]
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
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step (= DP x microbatches)")
    parser.add_argument("--layers", type=int, default=LAYERS, help="backbone blocks")
    parser.add_argument("--seed", type=int, default=0, help="data seed of round 0 (round r: seed + r)")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true",
                        help="1 round, 1 step, 2 blocks, 4 sequences, monolithic, arrival and ours")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.global_batch, args.layers = 1, 1, 4, 2
    cores = os.cpu_count() or 1
    if args.procs > cores:
        print(f"warning: {args.procs} processes on {cores} cores: contention, not the pipeline, sets the step time")
    shards = dataset(args.data, 2 if args.quick else 4)
    torch.set_num_threads(1)
    started = time.perf_counter()
    probe_server, probe_port, _ = create_server("127.0.0.1:0", decode_workers=0)  # 2 ahead: decodes little
    try:
        probe_argv = base_argv(f"127.0.0.1:{probe_port}", shards, args.layers, SEQ_LEN)
        seeds = [args.seed + 101 * i for i in range(args.procs)]  # one probe per process, all at once
        measured = measure_concurrently(probe_argv[1], [job_config(parse(probe_argv + ["--seed", str(s)]))
                                                        for s in seeds], args.layers, microbatches=6)
        spread = data_spread(probe_argv[1], probe_argv, measured)
    finally:
        probe_server.stop(0).wait()
    c = measured.content
    print(f"costs measured in {time.perf_counter() - started:.0f} s (forward s; backward = x factor): encoder "
          f"{measured.enc_s_per_token * 1e6:.0f} us/token, backbone {measured.bb_s_per_token * 1e6:.1f} us/token, "
          f"generator {measured.gen_s_per_image * 1e3:.1f} ms/image, backward factors "
          f"{tuple(round(f, 2) for f in measured.bwd_factor)}; mean microbatch {c.tokens} tokens, "
          f"{c.image_tokens} encoder tokens, {c.gen_images:.2f} images to generate")
    print(f"data heterogeneity over {SEQ_LEN}-token sequences: encoder tokens p0/p10/p50/p90/p100 "
          f"{'/'.join(str(int(v)) for v in spread['encoder_tokens_percentiles'].values())}, "
          f"{spread['no_image_share']:.0%} without media; forward+backward s per sequence "
          f"{'/'.join(f'{v:.2f}' for v in spread['sequence_s_percentiles'].values())}")
    # decode ahead: each stream's whole run is prepared during the warm-up steps, so the service
    # (on a cluster: its own CPU nodes) takes no core from the measured steps
    server, port, _ = create_server("127.0.0.1:0", decode_workers=0, prefetch=PREFETCH)
    address = f"127.0.0.1:{port}"
    workdir = Path(tempfile.mkdtemp(prefix="disttrain-bench-train-"))
    try:
        argv_ = base_argv(address, shards, args.layers, SEQ_LEN)
        costs = workdir / "costs.json"
        measured.save(costs)
        problem = measured.problem(args.procs, args.global_batch, args.layers)
        chosen = search_exact(problem)
        plans = {kind: search_exact(problem, kind) for kind in ("monolithic", "disaggregated")}
        if args.quick:
            plans = {"monolithic": plans["monolithic"]}
        configs = [Config(kind, plan, reorder) for kind, plan in plans.items() if plan
                   for reorder in (("arrival", "ours") if args.quick else REORDERS)]
        for kind, plan in plans.items():
            pick = " (the planner's pick)" if plan and chosen and plan.describe() == chosen.describe() else ""
            print(f"{kind}: {plan.describe() if plan else 'none fits'}{pick}; planner's estimate "
                  f"{plan.iteration_s if plan else float('nan'):.2f} s per step")
        for round_ in range(args.rounds):
            order = configs[round_ % len(configs):] + configs[:round_ % len(configs)]
            for config in order:
                run(config, address, argv_, costs, args.seed + round_, args.steps, workdir, round_)
            print(f"round {round_ + 1}/{args.rounds} done", flush=True)
        rows = report(configs)
        if args.json:
            args.json.write_text(json.dumps({"measured": dataclasses.asdict(measured),
                                             "data": spread, "procs": args.procs, "rows": rows}, indent=1, default=str))
    finally:
        server.stop(0).wait()
    return 0


def report(configs: list[Config]) -> list[dict]:
    """The table: per configuration the median measured and predicted step, the error, the
    error of the busy part alone (compute speed: step x (1 - idle share)), the idle shares, and
    the step time relative to no reordering on the same layout (measured: paired by step)."""
    print(f"\n{'layout':58s} {'reorder':8s} {'measured':>8s} {'range':>11s} {'predicted':>9s} {'error':>6s} "
          f"{'busy':>6s} {'idle':>5s} {'pred.':>5s} {'vs off':>6s} {'pred.':>6s}")
    base = {c.plan.describe(): c for c in configs if c.reorder == "arrival"}
    rows = []
    for c in configs:
        m, p = statistics.median(c.measured), statistics.median(c.predicted)
        busy = statistics.median((pr * (1 - pb)) / (me * (1 - b)) - 1 for pr, pb, me, b
                                 in zip(c.predicted, c.predicted_bubble, c.measured, c.bubble))
        off = base.get(c.plan.describe())
        ratio = paired_ratio(c, off) if off else float("nan")
        predicted_ratio = p / statistics.median(off.predicted) if off else float("nan")
        row = {"kind": c.name, "layout": c.plan.describe(), "reorder": c.reorder, "measured_s": m,
               "measured_min_s": min(c.measured), "measured_max_s": max(c.measured), "predicted_s": p,
               "error": p / m - 1, "busy_error": busy, "bubble": statistics.median(c.bubble),
               "predicted_bubble": statistics.median(c.predicted_bubble), "vs_arrival": ratio,
               "predicted_vs_arrival": predicted_ratio, "steps": len(c.measured)}
        rows.append(row)
        name = f"{c.name}: {c.plan.describe()}"
        print(f"{name[:58]:58s} {c.reorder:8s} {m:8.2f} {min(c.measured):5.2f}-{max(c.measured):5.2f} {p:9.2f} "
              f"{row['error']:+6.0%} {busy:+6.0%} {row['bubble']:5.0%} {row['predicted_bubble']:5.0%} {ratio:6.2f} "
              f"{predicted_ratio:6.2f}")
    ours = {r["kind"]: r for r in rows if r["reorder"] == "ours"}
    if "monolithic" in ours and "disaggregated" in ours:
        mono, dis = ours["monolithic"], ours["disaggregated"]
        print(f"\ndisaggregated / monolithic step time (ours): measured {dis['measured_s'] / mono['measured_s']:.2f}, "
              f"predicted {dis['predicted_s'] / mono['predicted_s']:.2f}")
    errors = [abs(r["error"]) for r in rows]
    print(f"prediction error: median {statistics.median(errors):.0%}, max {max(errors):.0%} "
          "(the simulator counts compute only; 'busy' is the error of the compute alone)")
    return rows


if __name__ == "__main__":
    sys.exit(main())
