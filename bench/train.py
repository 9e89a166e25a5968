"""Step time and bubble of the disaggregated runtime: the planner's layout vs the monolithic one,
with and without the service's reordering, on the same number of CPU processes.

    python bench/train.py [--procs 4] [--steps 8] [--global-batch 8] [--json FILE]

1. Profiles: each module's forward + backward seconds on the job's microbatches, measured in this
   process (one thread), become MeasuredProfiles; the orchestration planner picks the fastest
   disaggregated layout and the fastest monolithic grid for --procs processes (no TP on CPU).
2. Runs: torchrun with each layout, the service reordering with "ours" and with "arrival" (no
   reordering); median step time over the steps after the first two, and the mean idle share
   (bubble) of the ranks. All processes share this machine's cores, so a step's time also
   counts the processes' contention, not only the pipeline's structure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from preprocess_service.service.cli import ensure_demo_dataset  # noqa: E402
from preprocess_service.service.server import create_server  # noqa: E402
from trainer import DataClient  # noqa: E402
from trainer.models.backbone import lm_loss, lm_targets, spans_index  # noqa: E402
from trainer.models.config import ModelConfig  # noqa: E402
from trainer.models.mllm import MultimodalModel, media_index  # noqa: E402
from trainer.orchestration.planner import Problem, search_disaggregated, search_monolithic  # noqa: E402
from trainer.orchestration.profile import Accelerator, Content, MeasuredProfile  # noqa: E402
from trainer.train import job_config, parse  # noqa: E402

LAYERS = 4


def _fb(fn) -> float:
    start = time.perf_counter()
    out = fn()
    out.backward()
    return time.perf_counter() - start


def measure_profiles(address: str, argv: list[str], samples: int = 6) -> tuple[Problem, dict]:
    """Per-module forward+backward seconds on real microbatches -> the planner's problem."""
    torch.set_num_threads(1)
    args = parse(argv)
    model = MultimodalModel(ModelConfig(layers=LAYERS, max_positions=args.seq_len))
    enc, bb, gen, content = [], [], [], []
    with DataClient(address, job_config(args), 0, prefetch=2) as client:
        for _ in range(samples):
            mb = next(client)
            media = model.encode(mb)
            if media.shape[0]:
                enc.append(_fb(lambda: model.encode(mb).sum()) / media.shape[0])  # noqa: B023 (_fb calls it at once)
            x = model.backbone.embed_inputs(mb.tokens, mb.position_ids, media.detach(), media_index(mb))
            bb.append(_fb(lambda: lm_loss(model.backbone.logits(model.backbone.run_blocks(
                x, mb.cu_seqlens.tolist(), 0, LAYERS))[1], lm_targets(mb.tokens, mb.modality, mb.cu_seqlens))[0]))  # noqa: B023 (_fb calls it at once)
            if mb.gen_spans.shape[0]:
                queries = torch.randn(mb.gen_spans.shape[0], 64, model.config.dim)
                gen.append(_fb(lambda: model.generator.loss(queries, mb.gen_images, torch.Generator().manual_seed(0)))  # noqa: B023 (_fb calls it at once)
                           / mb.gen_spans.shape[0])
            content.append((mb.tokens.numel(), len(spans_index(mb.image_spans)) + len(spans_index(mb.audio_spans)),
                            mb.gen_spans.shape[0]))
    tokens, image_tokens, gens = (statistics.mean(c[i] for c in content) for i in range(3))
    per_enc = statistics.mean(enc) / 3 if enc else 0.0  # measured forward + backward; forward is a third
    per_token = statistics.mean(bb) / 3 / tokens
    per_gen = statistics.mean(gen) / 3 if gen else 0.0
    acc = Accelerator("CPU process", peak_flops=1e11, efficiency=1.0, memory_bytes=1e12, tp_link_bytes_s=1e9,
                      dp_link_bytes_s=1e12, max_tp=1)
    problem = Problem(encoder=MeasuredProfile("enc", 1e6, (0, 0, per_enc, 0), accelerator=acc),
                      backbone=MeasuredProfile("bb", 1e6, (per_token, 0, 0, 0), accelerator=acc),
                      generator=MeasuredProfile("gen", 1e6, (0, 0, 0, per_gen), accelerator=acc),
                      content=Content(tokens=int(tokens), image_tokens=int(image_tokens), gen_images=gens),
                      global_batch=args.bb_dp * args.num_microbatches, seqs_per_microbatch=1,
                      num_gpus=0, accelerator=acc, backbone_layers=LAYERS)
    measured = {"encoder_s_per_token": per_enc, "backbone_s_per_token": per_token, "generator_s_per_image": per_gen,
                "mean_tokens": tokens, "mean_media_tokens": image_tokens, "mean_gen_images": gens}
    return problem, measured


def run(address: str, shards: str, layout: tuple[int, int, int, int], reorder: str, steps: int,
        microbatches: int, workdir: Path) -> dict:
    enc, dp, pp, gen = layout
    log = workdir / f"log-{enc}-{dp}-{pp}-{gen}-{reorder}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(enc + dp * pp + gen),
           "-m", "trainer.train", "--address", address, "--shards", shards, "--enc-dp", str(enc), "--bb-dp", str(dp),
           "--bb-pp", str(pp), "--gen-dp", str(gen), "--steps", str(steps), "--num-microbatches", str(microbatches),
           "--seq-len", "2048", "--model-layers", str(LAYERS), "--reorder", reorder, "--log-json", str(log)]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=1200)
    records = [json.loads(line) for line in log.read_text().splitlines()][2:]
    return {"step_s": statistics.median(r["step_s"] for r in records),
            "bubble": statistics.mean(r["bubble_mean"] for r in records)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step (= DP x microbatches)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    shards = str(ensure_demo_dataset(REPO / "data" / "laion-demo")[0].parent)
    server, port, _ = create_server("127.0.0.1:0", decode_workers=0)
    address = f"127.0.0.1:{port}"
    workdir = Path(tempfile.mkdtemp(prefix="disttrain-bench-train-"))
    try:
        base = ["--address", address, "--shards", shards, "--seq-len", "2048", "--num-microbatches", "4",
                "--bb-dp", "1"]
        problem, measured = measure_profiles(address, base)
        problem = dataclasses.replace(problem, num_gpus=args.procs, global_batch=args.global_batch)
        layouts = {"planner (disaggregated)": search_disaggregated(problem), "monolithic": search_monolithic(problem)}
        print("measured on this machine (one thread):", {k: round(v, 6) for k, v in measured.items()})
        figures = {"measured": measured, "runs": {}}
        print(f"\n{'layout':60s} {'reorder':8s} {'step s':>7s} {'bubble':>7s} {'predicted s':>11s}")
        for kind, plan in layouts.items():
            if plan.kind == "monolithic":
                layout = (0, plan.bb.dp, plan.bb.pp, 0)
            else:
                layout = (plan.enc.dp, plan.bb.dp, plan.bb.pp, plan.gen.dp)
            for reorder in ("ours", "arrival"):
                result = run(address, shards, layout, reorder, args.steps, args.global_batch // plan.bb.dp, workdir)
                name = f"{kind}: {plan.describe()}"
                figures["runs"][f"{kind}/{reorder}"] = {"layout": plan.describe(), **result,
                                                       "predicted_step_s": plan.iteration_s}
                print(f"{name[:60]:60s} {reorder:8s} {result['step_s']:7.2f} {result['bubble']:7.1%} "
                      f"{plan.iteration_s:11.2f}")
        if args.json:
            args.json.write_text(json.dumps(figures, indent=1))
    finally:
        server.stop(0).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
