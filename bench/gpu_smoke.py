"""GPU smoke test of the trainer: the runs a first GPU machine must pass, each under a timeout (a
hang is a failure), printing step time and MFU.

    .venv/bin/python bench/gpu_smoke.py [--steps 12] [--timeout-s 300] [--peak-tflops 989]
                                        [--quick] [--device cuda|cpu] [--json FILE]

Against a local service (in this process, on synthetic LAION-style shards), with
``--device cuda --bf16``:

1. one GPU, the layout that fits one device (monolithic: encoder and generator inside the
   backbone's rank), M = 4, 2k steps, ``--deterministic``; it measures the modules' costs, which
   every later run reuses (``--costs``), so all runs plan their steps with the same prices;
2. four GPUs (when there are four), the disaggregated layout with P = 4 stages (encoder, two
   backbone stages, generator: one GPU each) and M = 8 microbatches;
3. a checkpoint and a resume: the same job to step k with a checkpoint there, then a run that
   resumes it to 2k; its losses must equal those of run 1 (bf16: within 1e-3);
4. every run logs the largest number of host syncs of any rank's step (one: reading the loss).

Step time is the median after the first two steps (warm-up: kernel selection, NCCL set-up). MFU is
6 x parameters x token positions per step / (step time x GPUs x --peak-tflops): an approximate
figure (the model is small: it measures the runtime's overhead, not a tuned kernel's speed).
``--device cpu`` (what ``--quick`` uses where no GPU is visible) runs 1 and 3 on the CPU with gloo, a
smoke run of this script itself, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))  # benchjson, when loaded from a test rather than run

import benchjson  # noqa: E402

SEQ_LEN = 2048
LAYERS = 4
QUICK_SEQ_LEN = 256
QUICK_LAYERS = 2
"""--quick's model and sequences: the same runs and checks, on a CPU in seconds per step, not minutes."""


def _torchrun(nproc: int, args: list[str], timeout_s: float, log: Path) -> tuple[float, list[dict], str]:
    """Runs the trainer; (wall seconds, its step records, its output tail). A timeout or a failure
    raises SystemExit naming the run."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "trainer.train", *args, "--log-json", str(log)]
    started = time.monotonic()
    # a session of its own: on a timeout torchrun and every worker it started go, freeing their GPUs
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise SystemExit(f"HANG: {' '.join(args[:12])} ... did not finish in {timeout_s:g} s\n"
                         f"{stderr[-3000:]}") from None
    if proc.returncode:
        raise SystemExit(f"FAILED ({proc.returncode}): {' '.join(cmd)}\n{stdout[-2000:]}\n{stderr[-4000:]}")
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    for line in [line for line in stderr.splitlines() if "host syncs" in line][:3]:  # which calls, where more than one
        print(line[:1500])
    return time.monotonic() - started, records, stdout[-2000:]


def _params(layers: int, seq_len: int) -> int:
    from trainer.models.config import ModelConfig
    from trainer.models.mllm import MultimodalModel

    model = MultimodalModel(ModelConfig(layers=layers, max_positions=seq_len))
    return sum(p.numel() for p in model.parameters())


def _figures(name: str, records: list[dict], gpus: int, microbatches: int, peak_tflops: float, *,
             layers: int, seq_len: int) -> list:
    steady = [r["step_s"] for r in records[2:]] or [r["step_s"] for r in records]
    step_s = statistics.median(steady)
    tokens_per_step = microbatches * seq_len
    flops = 6 * _params(layers, seq_len) * tokens_per_step
    mfu = f"{flops / (step_s * gpus * peak_tflops * 1e12):.2e}" if gpus else "n/a (CPU)"
    syncs = max(r.get("host_syncs_max", -1) for r in records)
    return [name, gpus or 1, len(records), round(step_s, 4), round(tokens_per_step / step_s), mfu, syncs,
            round(records[-1]["loss"], 4)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per run; past it the run counts as a hang")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="per GPU, bf16 dense (H100/H200 SXM: 989)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda where a GPU is visible, else cpu (a smoke run of this script)")
    p.add_argument("--quick", action="store_true", help="2 steps (a smoke run of this script)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    import torch

    from preprocess_service.service.server import create_server

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    if device == "cuda" and gpus == 0:
        raise SystemExit("--device cuda: no GPU is visible")
    steps = 2 if args.quick else max(args.steps, 4)
    seq_len, layers = (QUICK_SEQ_LEN, QUICK_LAYERS) if args.quick else (SEQ_LEN, LAYERS)
    size = {"layers": layers, "seq_len": seq_len}
    shards = benchjson.quick_shards(1, 40 if args.quick else 160)
    server, port, _ = create_server("127.0.0.1:0", decode_workers=2 if device == "cuda" else 0)
    address = f"127.0.0.1:{port}"
    rows, notes = [], []
    precision = ["--bf16"] if device == "cuda" else []

    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            # on a GPU the first run measures the modules' costs and the others reuse them, so every
            # run's job is planned with the same prices (the resumed run must see the same steps)
            costs = ["--costs", str(work / "costs.json")] if device == "cuda" else ["--profile-microbatches", "0"]

            def common(layout: list[str], microbatches: int, seed: int, n: int) -> list[str]:
                return ["--address", address, "--shards", *shards, "--device", device, *precision, *costs,
                        "--count-host-syncs", "--seq-len", str(seq_len), "--model-layers", str(layers),
                        "--num-microbatches", str(microbatches), "--seed", str(seed), "--steps", str(n),
                        "--enc-dp", layout[0], "--bb-dp", layout[1], "--bb-pp", layout[2], "--gen-dp", layout[3]]

            # 1. one device, monolithic, M = 4 (also the uninterrupted run of 3)
            k = steps // 2
            # deterministic kernels: run 3 compares the resumed losses with these
            whole = common(["0", "1", "1", "0"], 4, 21, 2 * k) + ["--deterministic"]
            _, uninterrupted, out = _torchrun(1, whole, args.timeout_s, work / "one.jsonl")
            rows.append(_figures("1 GPU, monolithic, M=4" if gpus else "1 CPU process, monolithic, M=4",
                                 uninterrupted, gpus, 4, args.peak_tflops, **size))
            print(out, flush=True)
            # 2. four devices, disaggregated, P = 4 stages, M = 8
            if gpus >= 4:
                four = common(["1", "1", "2", "1"], 8, 22, steps)
                _, records, out = _torchrun(4, four, args.timeout_s, work / "four.jsonl")
                rows.append(_figures("4 GPUs, disaggregated enc|bb|bb|gen, M=8", records, 4, 8,
                                     args.peak_tflops, **size))
                print(out, flush=True)
            else:
                notes.append(f"the 4-GPU disaggregated run needs 4 GPUs; {gpus} visible: not run")
            # 3. checkpoint at k and resume to 2k, against the uninterrupted run
            ckpt = ["--checkpoint-dir", str(work / "ckpt"), "--checkpoint-every", str(k)]
            _torchrun(1, common(["0", "1", "1", "0"], 4, 21, k) + ["--deterministic"] + ckpt, args.timeout_s,
                      work / "first.jsonl")
            _, resumed, _ = _torchrun(1, whole + ckpt, args.timeout_s, work / "resumed.jsonl")
            expected = {r["step"]: r["loss"] for r in uninterrupted}
            got = {r["step"]: r["loss"] for r in resumed}
            if sorted(got) != list(range(k, 2 * k)):
                raise SystemExit(f"FAILED: the resumed run ran steps {sorted(got)}, expected {k}..{2 * k - 1}")
            worst = max(abs(got[s] - expected[s]) / max(abs(expected[s]), 1e-9) for s in got)
            tolerance = 1e-3 if precision else 1e-6
            if worst > tolerance:
                raise SystemExit(f"FAILED: the resumed losses differ from the uninterrupted run's by {worst:.2e} "
                                 f"(relative; allowed {tolerance:g})")
            rows.append(_figures(f"resumed at step {k} (losses within {worst:.1e} of the uninterrupted run)",
                                 resumed, gpus, 4, args.peak_tflops, **size))
    finally:
        server.stop(0).wait()

    columns = ["run", "devices", "steps", "step s (median after 2)", "token positions/s", "MFU (approx)",
               "host syncs per step (max)", "last loss"]
    width = max(len(r[0]) for r in rows)
    print(f"{'run':<{width}}  " + "  ".join(columns[1:]))
    for row in rows:
        print(f"{row[0]:<{width}}  " + "  ".join(str(v) for v in row[1:]))
    for note in notes:
        print(f"note: {note}")
    bad = [r[0] for r in rows if r[6] != 1]
    if bad:
        raise SystemExit(f"FAILED: more than one host sync per step in {bad}")
    doc = benchjson.document("gpu_smoke", quick=args.quick or device == "cpu")
    doc["title"] = "GPU smoke test"
    device_name = torch.cuda.get_device_name(0) if gpus else "CPU (gloo): a smoke run, not a measurement"
    doc["tables"].append(benchjson.table(f"trainer on {device_name}, bf16" if gpus else f"trainer on {device_name}",
                                         columns, rows, notes=notes))
    benchjson.write(args.json, doc)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
