"""SIMULATION at paper scale: the planner on published model sizes and a stated accelerator.

    python -m trainer.orchestration.simulate [--gpus 1152] [--global-batch 1536]

Nothing here is measured. Modules are priced by their FLOPs (profile.FlopProfile) on a simulated
H100 (989 TFLOP/s dense bf16, 55% achievable, 80 GB, 450 GB/s NVLink and 50 GB/s network per GPU):
- encoder: ViT-H/14 (632M parameters, 32 layers, hidden 1280), 4 patches per merged image token;
- generator: Stable Diffusion 2.1 UNet (865M parameters), ~0.8 TFLOP forward per 512x512 image
  (one noise-prediction step per training sample), modelled as 462 effective positions;
- backbones: Llama-like 7B (32 x 4096), 13B (40 x 5120) and a 72B (80 x 8192), 8192-token
  sequences of 2048-token documents;
- one sequence per microbatch holding 4 images of 1024 tokens (4096 encoder tokens = 16384 ViT
  patches) and 1 image to generate.

Every sequence is priced alike here, so data heterogeneity (and what reordering does about it) is
out of view: bench/paper.py runs the same modules on LAION-like packed sequences through the
service's planners and exact 1F1B simulator, on A800 (the paper's GPU) and H100.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from trainer.orchestration.planner import Plan, Problem, allreduce_s, search_disaggregated, search_monolithic
from trainer.orchestration.profile import H100, Accelerator, Content, FlopProfile

VIT_H = FlopProfile("ViT-H/14", params=632e6, layers=32, hidden=1280, accelerator=H100, work_per="image_token",
                    patches_per_token=4)
SD21 = FlopProfile("SD-2.1 UNet", params=865e6, layers=0, hidden=0, accelerator=H100, work_per="gen_image",
                   work_per_gen_image=462.0)
BACKBONES = {
    "7B": (FlopProfile("Llama-7B", params=6.7e9, layers=32, hidden=4096, accelerator=H100, work_per="token"), 32),
    "13B": (FlopProfile("Llama-13B", params=13e9, layers=40, hidden=5120, accelerator=H100, work_per="token"), 40),
    "72B": (FlopProfile("72B", params=72e9, layers=80, hidden=8192, accelerator=H100, work_per="token"), 80),
}
CONTENT = Content(tokens=8192, image_tokens=4096, gen_images=1.0, doc_len=2048)


def on(profile: FlopProfile, accelerator: Accelerator) -> FlopProfile:
    """The same module priced on another accelerator."""
    return dataclasses.replace(profile, accelerator=accelerator)


def grad_sync_s(problem: Problem, plan: Plan) -> float:
    """The gradient all-reduce the planner adds to ``plan``'s iteration (the slowest group's, not
    overlapped with compute), so that an exact simulation of the same layout adds the same."""
    bb_params = problem.backbone.params / plan.bb.pp
    if plan.kind == "monolithic":
        return allreduce_s(problem, (bb_params + problem.encoder.params) / plan.bb.tp, plan.bb.dp)
    return max(allreduce_s(problem, problem.encoder.params / plan.enc.tp, plan.enc.dp),
               allreduce_s(problem, bb_params / plan.bb.tp, plan.bb.dp),
               allreduce_s(problem, problem.generator.params / plan.gen.tp, plan.gen.dp))


def paper_scale(num_gpus: int = 1152, global_batch: int = 1536, backbones=("7B", "13B", "72B")) -> list[dict]:
    rows = []
    for name in backbones:
        backbone, layers = BACKBONES[name]
        problem = Problem(encoder=VIT_H, backbone=backbone, generator=SD21, content=CONTENT,
                          global_batch=global_batch, seqs_per_microbatch=1, num_gpus=num_gpus,
                          accelerator=H100, backbone_layers=layers, p2p_s=20e-6)
        dis, mono = search_disaggregated(problem), search_monolithic(problem)
        rows.append({"backbone": name, "disaggregated": dis, "monolithic": mono,
                     "ratio": dis.throughput / mono.throughput})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=1152, help="GPU budget (default 1152 = 144 nodes x 8)")
    parser.add_argument("--global-batch", type=int, default=1536, help="sequences of 8192 tokens per step")
    args = parser.parse_args(argv)
    print(f"SIMULATION (no measurement): {args.gpus} simulated H100, global batch {args.global_batch} x 8192 "
          "tokens, ViT-H/14 encoder, SD-2.1 generator")
    for row in paper_scale(args.gpus, args.global_batch):
        print(f"\nbackbone {row['backbone']}:")
        for kind in ("disaggregated", "monolithic"):
            plan = row[kind]
            print(f"  {kind:14s} {plan.describe()}")
            print(f"  {'':14s} {plan.gpus} GPUs, M={plan.num_microbatches}, iteration {plan.iteration_s:6.2f} s, "
                  f"{plan.throughput:6.1f} seq/s, MFU {plan.mfu:5.1%}, "
                  f"peak memory {plan.peak_memory_bytes / 1e9:5.1f} GB")
        print(f"  predicted throughput disaggregated / monolithic: {row['ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
