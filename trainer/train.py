"""Disaggregated multimodal training, launched with torchrun:

    torchrun --nproc-per-node 4 -m trainer.train --address HOST:PORT --shards DATA \\
        --enc-dp 2 --bb-dp 1 --bb-pp 1 --gen-dp 1 --steps 20

Each module has its own DP and TP (--enc-tp, --bb-tp, --gen-tp; Megatron-style tensor
parallelism, runtime/tensor_parallel.py); --enc-dp 0 --gen-dp 0 is the monolithic layout.

Builds one process group per module from the layout (runtime/layout.py), runs each step's 1F1B
schedule with point-to-point activations and gradients, reduces each module's gradients inside
its own DP group, takes one optimizer step per global batch, and logs per-step time, loss and
each rank's busy/idle time (the bubble). With --checkpoint-dir every rank saves its module,
optimizer and (backbone stage 0) the data client's state at step boundaries, and a restart
continues from the newest complete checkpoint with exactly the data it would have had.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from disttrain_api.cli_args import add_job_arguments, job_fields
from disttrain_api.config import JobConfig
from trainer.models.config import ModelConfig
from trainer.models.mllm import MultimodalModel
from trainer.runtime.layout import RuntimeLayout
from trainer.runtime.tensor_parallel import TPGroup
from trainer.runtime.workers import BackboneWorker, EncoderWorker, GeneratorWorker

TRAINER_JOB_ARGUMENTS = ("seq_len", "num_microbatches", "seqs_per_microbatch", "seed", "reorder_algorithm",
                         "shuffle_buffer", "pack_window", "max_consecutive_errors", "max_error_fraction")
"""The job fields the trainer's command line sets; dp_size comes from --bb-dp, the rest from JobConfig."""


def parse(argv):
    """Flags, after those in $DISTTRAIN_TRAIN_ARGS (a Kubernetes ConfigMap sets the job there);
    --address defaults to $DISTTRAIN_ADDRESS."""
    argv = shlex.split(os.environ.get("DISTTRAIN_TRAIN_ARGS", "")) + list(sys.argv[1:] if argv is None else argv)
    address = os.environ.get("DISTTRAIN_ADDRESS")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", required=address is None, default=address,
                   help="preprocessing service address(es), comma-separated, or dns:///NAME:PORT "
                        "($DISTTRAIN_ADDRESS)")
    p.add_argument("--shards", nargs="+", required=True)
    add_job_arguments(p, TRAINER_JOB_ARGUMENTS)  # JobConfig's names, defaults and help
    p.add_argument("--enc-dp", type=int, default=1)
    p.add_argument("--bb-dp", type=int, default=1)
    p.add_argument("--bb-pp", type=int, default=1)
    p.add_argument("--gen-dp", type=int, default=1)
    p.add_argument("--enc-tp", type=int, default=1)
    p.add_argument("--bb-tp", type=int, default=1)
    p.add_argument("--gen-tp", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--model-layers", type=int, default=4)
    p.add_argument("--checkpoint-dir", type=Path)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--log-json", type=Path, help="rank 0 appends one JSON line per step here")
    p.add_argument("--save-params", type=Path, help="every rank writes its module's final parameters here")
    p.add_argument("--feedback", action="store_true",
                   help="report each microbatch's measured stage times; the service refits its cost model")
    return p.parse_args(argv)


def job_config(args) -> JobConfig:
    return JobConfig(shards=tuple(args.shards), dp_size=args.bb_dp, num_epochs=1000, cost_feedback=args.feedback,
                     **job_fields(args, TRAINER_JOB_ARGUMENTS))


def runtime_layout(args) -> RuntimeLayout:
    if args.enc_dp == 0 and args.enc_tp != 1 or args.gen_dp == 0 and args.gen_tp != 1:
        raise SystemExit("an encoder or generator run inside a backbone stage (--enc-dp 0 / --gen-dp 0) "
                         "uses the backbone's TP: leave --enc-tp / --gen-tp at 1")
    return RuntimeLayout(args.enc_dp, args.bb_dp, args.bb_pp, args.gen_dp, args.enc_tp, args.bb_tp, args.gen_tp)


def build_worker(args, layout: RuntimeLayout, rank: int, groups: dict):
    """This rank's worker, its module sharded for its TP rank."""
    torch.manual_seed(args.seed)  # the same initial weights on every rank; each keeps its module
    model = MultimodalModel(ModelConfig(layers=args.model_layers, max_positions=args.seq_len))
    ranks = layout.tp_ranks(rank)
    tp = TPGroup(layout.tp_rank(rank), len(ranks), groups.get(tuple(ranks)), tuple(ranks))
    common = (model, layout, args.num_microbatches, args.seed)
    role = layout.role(rank)
    if role[0] == "enc":
        return EncoderWorker(*common, replica=role[1], tp=tp)
    if role[0] == "gen":
        return GeneratorWorker(*common, replica=role[1], gen_weight=model.config.gen_loss_weight, tp=tp)
    _, dp, stage = role
    client = None
    if stage == 0 and tp.leader:  # the other TP ranks get the microbatches from their leader
        from trainer import DataClient

        client = DataClient(args.address, job_config(args), dp, prefetch=args.num_microbatches)
    return BackboneWorker(*common, dp=dp, stage=stage, client=client, stage0_group=groups["bb0.tp0"], tp=tp)


def fill_missing_grads(params) -> None:
    """A parameter no microbatch used (no audio in the step, say) gets a zero gradient, so every
    parameter takes an optimizer step every step, on every rank and in the reference alike."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def reduce_gradients(params, group, size: int) -> None:
    fill_missing_grads(params)
    if size == 1:
        return
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset:offset + g.numel()].view_as(g).clone()
        offset += g.numel()


def checkpoint_path(directory: Path, step: int, rank: int) -> Path:
    return directory / f"step{step:06d}" / f"rank{rank}.pt"


def latest_checkpoint(directory: Path | None, world: int) -> int:
    """The newest step every rank saved (0: none)."""
    if directory is None or not directory.exists():
        return 0
    steps = sorted((int(d.name[4:]) for d in directory.glob("step*")
                    if all((d / f"rank{r}.pt").exists() for r in range(world))), reverse=True)
    return steps[0] if steps else 0


def main(argv=None) -> int:
    args = parse(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    layout = runtime_layout(args)
    if layout.world_size != world:
        raise SystemExit(f"the layout needs {layout.world_size} processes, torchrun started {world}")
    # every rank creates every group, in the same order
    groups = {name: dist.new_group(ranks) for name, ranks in layout.groups().items()}
    groups.update({tuple(ranks): dist.new_group(ranks) for ranks in layout.tp_groups()})
    sizes = {name: len(ranks) for name, ranks in layout.groups().items()}
    worker = build_worker(args, layout, rank, groups)
    group = layout.group_of(rank)
    params = worker.parameters()
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    source = layout.bb_rank(0, 0)  # reads the first microbatch of every step
    start = latest_checkpoint(args.checkpoint_dir, world)
    if start:
        state = torch.load(checkpoint_path(args.checkpoint_dir, start, rank), weights_only=False)
        for p, saved in zip(params, state["params"]):
            p.data.copy_(saved)
        optimizer.load_state_dict(state["optimizer"])
        if getattr(worker, "client", None) is not None:
            worker.client.load_state_dict(state["data"])
    for step in range(start, args.steps):
        worker.busy_s, worker.loss_parts, worker.per_microbatch = 0.0, torch.zeros(2, dtype=torch.float64), {}
        began = time.perf_counter()
        # every rank runs the step's 1F1B over the number of microbatches the service planned for it
        num = torch.tensor([worker.peek_num_microbatches(step) if rank == source else 0])
        dist.broadcast(num, src=source)
        worker.M = int(num)
        worker.run_step(step)
        worker.outbox.wait()
        reduce_gradients(params, groups[group], sizes[group])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - began
        stats = torch.tensor([*worker.loss_parts.tolist(), elapsed, worker.busy_s], dtype=torch.float64)
        gathered = [torch.zeros_like(stats) for _ in range(world)]
        dist.all_gather(gathered, stats)
        record = _record(step, layout, gathered)
        if rank == 0:
            _log(args, record)
        if args.feedback:
            _feed_back(worker, layout, step, record["bubble_mean"])
        if args.checkpoint_dir and (step + 1) % args.checkpoint_every == 0:
            _save(args, step + 1, rank, worker, params, optimizer)
            dist.barrier()  # every rank's file is written: the checkpoint is complete
            if getattr(worker, "client", None) is not None:
                worker.client.acknowledge(step + 1)  # the service may drop the plans before it
    if args.save_params:
        args.save_params.mkdir(parents=True, exist_ok=True)
        torch.save({"role": layout.role(rank), "params": [p.detach() for p in params],
                    "shards": [getattr(p, "tp_shard", None) for p in params]}, args.save_params / f"rank{rank}.pt")
    if getattr(worker, "client", None) is not None:
        worker.client.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _feed_back(worker, layout: RuntimeLayout, step: int, bubble: float) -> None:
    """Gathers every rank's per-microbatch busy seconds into [bb_dp, M, module]; each chain's
    stage 0 reports its row to the service, which refits its cost model. A TP group counts
    once (its leader's time)."""
    table = torch.zeros(layout.bb_dp, worker.M, 3, dtype=torch.float64)
    for (d, m), seconds in worker.per_microbatch.items():
        if worker.tp.leader:
            table[d, m, worker.module_index] += seconds
    dist.all_reduce(table)
    if getattr(worker, "client", None) is not None:
        worker.client.report_timings([(step, m, *table[worker.dp, m].tolist()) for m in range(worker.M)],
                                     bubble=(step, bubble))


def _save(args, step: int, rank: int, worker, params, optimizer) -> None:
    path = checkpoint_path(args.checkpoint_dir, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"params": [p.detach() for p in params], "optimizer": optimizer.state_dict()}
    if getattr(worker, "client", None) is not None:
        state["data"] = worker.client.state_dict()
    torch.save(state, str(path) + ".tmp")
    os.replace(str(path) + ".tmp", path)


def _record(step: int, layout: RuntimeLayout, gathered: list[torch.Tensor]) -> dict:
    """The step's loss, time and per-module bubble from every rank's (loss parts, seconds, busy seconds)."""
    rows = torch.stack(gathered)
    loss = float(rows[:, 0].sum() + rows[:, 1].sum())
    step_s = float(rows[:, 2].max())
    busy = {}
    for r in range(layout.world_size):
        role = layout.role(r)
        name = role[0] if role[0] != "bb" else f"bb{role[2]}"
        busy.setdefault(name, []).append(float(rows[r, 3]))
    bubble = {name: 1 - sum(v) / len(v) / step_s for name, v in busy.items()}
    return {"step": step, "loss": loss, "step_s": step_s, "bubble": bubble,
            "bubble_mean": 1 - float(rows[:, 3].sum()) / (step_s * layout.world_size)}


def _log(args, record: dict) -> None:
    step, loss, step_s, bubble = record["step"], record["loss"], record["step_s"], record["bubble"]
    print(f"step {step:4d}  loss {loss:8.4f}  {step_s:6.2f} s  bubble " +
          " ".join(f"{k} {v:4.0%}" for k, v in bubble.items()), flush=True)
    if args.log_json:
        with open(args.log_json, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    sys.exit(main())
