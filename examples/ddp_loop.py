"""A plain DDP training loop over a small Hugging Face causal LM that reads images, fed by the
service through ``ServiceDataset`` and a ``DataLoader``: no disaggregation, no pipeline.

    torchrun --nproc-per-node 2 examples/ddp_loop.py --address HOST:PORT --shards DATA [--steps 4]
        [--calibrate-steps 2]

The model is a Llama built from a config (no downloaded weights) plus a linear projection of each
image's 28 x 28 pixel blocks into the token embeddings at the image's placeholder tokens (the
service sizes images so that one token is one such block). Each microbatch is packed documents:
attention is causal inside each document (a block-diagonal mask from ``cu_seqlens``), positions
restart per document, and the text loss is summed over ``labels`` (-100 where not trained) and
divided by the step's trained tokens over every rank. Audio and generation targets stay
placeholder tokens here. Each step is ``num_microbatches`` microbatches of gradient accumulation,
then one optimizer step; the data position is checkpointed with ``dataset.state_dict()``.
With ``--calibrate-steps N`` the job takes cost feedback and a ``CostProfiler`` times forward +
backward of each microbatch for N steps after a warm-up step: the service refits its cost model to
this model's own times and balances the steps it plans afterwards with them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from disttrain_api.config import MONOLITHIC, JobConfig
from trainer import CostProfiler, Microbatch, ParallelLayout, ServiceDataset

BLOCK = 28
"""Pixels along one side of one image token: the job's patch_size x merge_size (14 x 2)."""


class ImageLM(nn.Module):
    """A causal LM whose image placeholder tokens are replaced by projected pixel blocks."""

    def __init__(self, vocab_size: int, dim: int = 64, layers: int = 2, heads: int = 4, max_positions: int = 4096):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.lm = LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab_size, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_positions))
        self.project = nn.Linear(BLOCK * BLOCK * 3, dim)

    def forward(self, mb: Microbatch) -> torch.Tensor:
        """The summed text loss of one microbatch."""
        embeds = self.lm.get_input_embeddings()(mb.tokens.long())  # [S, L, D]
        flat = embeds.reshape(-1, embeds.shape[-1]).clone()
        for image, (start, end) in zip(mb.images, mb.image_spans.tolist()):
            h, w, _ = image.shape
            blocks = image.reshape(h // BLOCK, BLOCK, w // BLOCK, BLOCK, 3).permute(0, 2, 1, 3, 4)
            flat[start:end] = self.project(blocks.reshape(-1, BLOCK * BLOCK * 3).float() / 255.0)
        embeds = flat.reshape(embeds.shape)
        logits = self.lm(inputs_embeds=embeds, position_ids=mb.position_ids.long(),
                         attention_mask=document_mask(mb)).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), mb.labels.reshape(-1),
                               ignore_index=-100, reduction="sum")


def document_mask(mb: Microbatch) -> torch.Tensor:
    """bool [S, 1, L, L]: position i attends to j <= i of its own document (packed sequences)."""
    S, L = mb.tokens.shape
    segment = torch.zeros(S * L, dtype=torch.long)
    bounds = mb.cu_seqlens.tolist()
    for index, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        segment[start:end] = index
    segment = segment.reshape(S, L)
    same = segment[:, :, None] == segment[:, None, :]
    return (same & torch.ones(L, L, dtype=torch.bool).tril())[:, None]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", required=True, help="the service, host:port")
    parser.add_argument("--shards", nargs="+", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--calibrate-steps", type=int, default=0,
                        help="time this many steps (after one warm-up step) and refit the service's costs to them")
    parser.add_argument("--log-json", help="a JSON line per step (step, loss) is appended here")
    parser.add_argument("--save-state", help="the data position is saved here at the end")
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    layout = ParallelLayout.from_torch()  # plain DDP: every rank its own data-parallel rank
    config = JobConfig(shards=tuple(args.shards), seq_len=args.seq_len, dp_size=layout.dp_size,
                       num_microbatches=args.microbatches, stage_map=MONOLITHIC, seed=0,
                       cost_feedback=args.calibrate_steps > 0)
    dataset = ServiceDataset(args.address, config, layout)
    profiler = CostProfiler(dataset.client, steps=args.calibrate_steps) if args.calibrate_steps else None
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DistributedDataParallel(ImageLM(vocab_size=dataset.client.info.tokenizer.vocab_size,
                                            max_positions=args.seq_len))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, parts, trained = [], [], 0
    for mb in DataLoader(dataset, batch_size=None):
        last = mb.microbatch_index + 1 == mb.num_microbatches
        timing = profiler.measure(mb) if profiler is not None else contextlib.nullcontext()
        with timing, model.no_sync() if not last else contextlib.nullcontext():
            loss = model(mb)
            loss.backward()  # summed; scaled below by the step's trained tokens over every rank
        parts.append(loss.detach())
        trained += int((mb.labels != -100).sum())
        if last:
            totals = torch.tensor([float(sum(parts)), float(trained)])
            dist.all_reduce(totals)
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(layout.dp_size / max(totals[1].item(), 1.0))  # DDP averaged: undo, then per token
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(totals[0].item() / max(totals[1].item(), 1.0))
            if args.log_json and layout.rank == 0:
                with open(args.log_json, "a") as f:
                    f.write(json.dumps({"step": mb.step, "loss": losses[-1]}) + "\n")
            parts, trained = [], 0
            if mb.step + 1 >= args.steps:
                break  # between steps: the saved position is the next step's start
    if args.save_state:
        state = dataset.state_dict()  # acknowledged to the service as well
        with open(f"{args.save_state}.rank{layout.rank}.json", "w") as f:
            json.dump(state, f)
    dataset.close()
    dist.destroy_process_group()
    print(f"rank {layout.rank}: {len(losses)} steps, losses {[round(x, 3) for x in losses]}", flush=True)
    if profiler is not None and profiler.last_ack is not None:
        ack = profiler.last_ack
        print(f"rank {layout.rank}: costs refit from {ack.num_observations} timed microbatches (fit error "
              f"{100 * ack.total_rel_error:.1f}%), steps from {ack.first_step_priced} priced with "
              f"bb_linear_s={ack.cost.bb_linear_s:.3g} enc_linear_s={ack.cost.enc_linear_s:.3g}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
