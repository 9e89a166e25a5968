"""Disaggregated multimodal training, launched with torchrun:

    torchrun --nproc-per-node 4 -m trainer.train --address HOST:PORT --shards DATA \\
        --enc-dp 2 --bb-dp 1 --bb-pp 1 --gen-dp 1 --steps 20

Each module has its own DP and TP (--enc-tp, --bb-tp, --gen-tp; Megatron-style tensor
parallelism, runtime/tensor_parallel.py); --enc-dp 0 --gen-dp 0 is the monolithic layout.

The layout (disttrain_api.layout.PipelineLayout) is the flags', or with --orchestrate the one the
orchestration planner picks for the world size from per-module costs rank 0 measures on a few
microbatches first (trainer/orchestration/measure.py). The trainer opens the job with that layout
(stage map, which encoder/generator replica serves which backbone ranks) and the measured costs
(--profile-microbatches), so the service plans for the pipeline this run executes; a restart
takes both from the checkpoint, so it reopens the same job.

Builds one process group per module from the layout, runs each step's 1F1B
schedule with point-to-point activations and gradients, reduces each module's gradients inside
its own DP group, takes one optimizer step per global batch, and logs per-step time, loss and
each rank's busy/idle time (the bubble). With --checkpoint-dir every rank saves its module,
optimizer and (backbone stage 0) the data client's state at step boundaries, and a restart
continues from the newest complete checkpoint with exactly the data it would have had.

Elastic restart: a run restarted with another number of processes (a node lost: --bb-dp 2 -> 1,
or more ranks) continues from the newest complete checkpoint when only data-parallel sizes
changed (the same pipeline stages and TP degrees): each rank loads the weights and optimizer of
the saved rank in its place at DP replica 0 (data parallelism keeps replicas equal), and the data
clients continue the job's lineage at that step with the new dp_size (the service plans the next
global batches of the same sequence stream; every sample of the epoch is still delivered once).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from disttrain_api.cli_args import add_job_arguments, job_fields
from disttrain_api.config import CostConfig, JobConfig
from disttrain_api.layout import PipelineLayout
from trainer.models.config import ModelConfig
from trainer.models.mllm import MultimodalModel
from trainer.runtime.p2p import Channels, connect
from trainer.runtime.syncs import HostSyncCounter
from trainer.runtime.tensor_parallel import TPGroup
from trainer.runtime.workers import BackboneWorker, EncoderWorker, GeneratorWorker, message_pairs

TRAINER_JOB_ARGUMENTS = ("seq_len", "num_microbatches", "seqs_per_microbatch", "seed", "reorder_algorithm",
                         "shuffle_buffer", "pack_window", "max_consecutive_errors", "max_error_fraction", "tokenizer")
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
    p.add_argument("--orchestrate", action="store_true",
                   help="the orchestration planner picks the layout for the world size (ignores --enc-dp .. "
                        "--gen-tp and --num-microbatches; needs --global-batch)")
    p.add_argument("--global-batch", type=int, default=0,
                   help="sequences per step with --orchestrate (= backbone DP x microbatches)")
    p.add_argument("--profile-microbatches", type=int, default=2,
                   help="rank 0 times each module on this many microbatches of a probe job and opens the job "
                        "with those costs (0: the job's default cost model)")
    p.add_argument("--costs", type=Path,
                   help="per-module costs as JSON: read from this file if it exists (no probe), else measured and "
                        "written there, so later runs plan with the same prices")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: gloo; cuda: NCCL, one GPU per process (LOCAL_RANK), pinned-memory prefetch and "
                        "non_blocking copies")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for the forward passes (CPU or GPU)")
    p.add_argument("--deterministic", action="store_true",
                   help="on a GPU: no TF32 matmuls or convolutions, deterministic cuDNN and cuBLAS, deterministic "
                        "algorithms where torch has them (what comparing two runs or a CPU reference needs); slower")
    p.add_argument("--count-host-syncs", action="store_true",
                   help="count the host syncs (.item(), .tolist(), synchronize, ...) of each step's ops and of its "
                        "end, and log the largest count over the ranks (host_syncs_max); for tests")
    p.add_argument("--p2p-channels", choices=("per-kind", "shared"), default="per-kind",
                   help="per-kind: one communicator per message kind (messages of a kind are posted in the order "
                        "they are received); shared: one for all (they would match across kinds in posting order, "
                        "as NCCL matches: only to show that the per-kind channels are needed)")
    p.add_argument("--trace", type=Path, help="every rank writes the ops it ran per step here (rank{R}.json)")
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
    p.add_argument("--keys-log", type=Path, help="each data rank appends a STEP KEY line per sample it receives to "
                                                "DIR/bbD.keys (D: its data-parallel rank)")
    p.add_argument("--feedback", action="store_true",
                   help="report each microbatch's measured stage times; the service refits its cost model")
    return p.parse_args(argv)


def job_config(args, cost: CostConfig | None = None) -> JobConfig:
    """The job this run trains on: the flags' fields, the layout's pipeline, the measured costs."""
    layout = runtime_layout(args)
    model = layout.stage_model()
    extra = {"cost": cost} if cost is not None else {}
    return JobConfig(shards=tuple(args.shards), dp_size=layout.bb_dp, num_epochs=1000, cost_feedback=args.feedback,
                     stage_map=model.stage_map, enc_shared_by=layout.enc_shared_by,
                     gen_shared_by=layout.gen_shared_by, enc_split_by=layout.enc_split_by,
                     gen_split_by=layout.gen_split_by, **extra, **job_fields(args, TRAINER_JOB_ARGUMENTS))


def job_vocab_size(args, cost: CostConfig | None = None) -> int:
    """Token ids the model embeds: the byte tokenizer's, or what the service reports for the job's
    tokenizer (JobInfo.tokenizer.vocab_size, its added special tokens counted). Every rank asks,
    so every rank builds the same model."""
    if args.tokenizer in ("", "byte"):
        return ModelConfig().vocab_size
    from trainer import DataClient

    with DataClient(args.address, job_config(args, cost), 0, prefetch=1) as probe:  # opens the job, no stream
        return int(probe.info.tokenizer.vocab_size)


def runtime_layout(args) -> PipelineLayout:
    try:
        return PipelineLayout(args.enc_dp, args.bb_dp, args.bb_pp, args.gen_dp, args.enc_tp, args.bb_tp, args.gen_tp)
    except ValueError as exc:
        raise SystemExit(f"layout: {exc}") from None


def build_worker(args, layout: PipelineLayout, rank: int, groups: dict, cost: CostConfig | None = None,
                 device: torch.device | None = None, channels: Channels | None = None, stage0_group=None):
    """This rank's worker, its module sharded for its TP rank and (only its own modules) on ``device``.
    ``stage0_group``: a CPU group of the backbone's stage-0 TP leaders (the step's counts)."""
    vocab_size = job_vocab_size(args, cost)
    torch.manual_seed(args.seed)  # the same initial weights on every rank; each keeps its module
    model = MultimodalModel(ModelConfig(layers=args.model_layers, max_positions=args.seq_len, vocab_size=vocab_size))
    ranks = layout.tp_ranks(rank)
    tp = TPGroup(layout.tp_rank(rank), len(ranks), groups.get(tuple(ranks)), tuple(ranks))
    common = (model, layout, args.num_microbatches, args.seed)
    options = {"tp": tp, "device": device or "cpu", "channels": channels}
    role = layout.role(rank)
    if role[0] == "enc":
        worker = EncoderWorker(*common, replica=role[1], **options)
    elif role[0] == "gen":
        worker = GeneratorWorker(*common, replica=role[1], gen_weight=model.config.gen_loss_weight, **options)
    else:
        _, dp, stage = role
        client = None
        if stage == 0 and tp.leader:  # the other TP ranks get the microbatches from their leader
            from trainer import DataClient

            client = DataClient(args.address, job_config(args, cost), dp, prefetch=args.num_microbatches,
                                pin_memory=device is not None and device.type == "cuda")
        worker = BackboneWorker(*common, dp=dp, stage=stage, client=client, stage0_group=stage0_group, **options)
    worker.to_device()  # after sharding: each rank holds its slices of its own modules
    return worker


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
    """The newest step every rank of the run that saved it saved (its ``layout.json`` names its
    world size; without one, ``world``); 0: none."""
    if directory is None or not directory.exists():
        return 0
    steps = sorted((int(d.name[4:]) for d in directory.glob("step*")
                    if all((d / f"rank{r}.pt").exists() for r in range(saved_world(d, world)))), reverse=True)
    return steps[0] if steps else 0


LAYOUT_FIELDS = ("enc_dp", "bb_dp", "bb_pp", "gen_dp", "enc_tp", "bb_tp", "gen_tp")


def saved_world(step_dir: Path, default: int) -> int:
    try:
        return int(json.loads((step_dir / "layout.json").read_text())["world"])
    except (OSError, ValueError, KeyError, TypeError):
        return default


def saved_layout(directory: Path, step: int) -> PipelineLayout | None:
    """The layout the checkpoint of ``step`` was saved with (None: an older checkpoint without one)."""
    try:
        saved = json.loads((checkpoint_path(directory, step, 0).parent / "layout.json").read_text())
        return PipelineLayout(*(int(saved[name]) for name in LAYOUT_FIELDS))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def source_rank(saved: PipelineLayout, layout: PipelineLayout, rank: int) -> int:
    """The saved rank whose weights ``rank`` of ``layout`` loads: its own place at DP replica 0 of the
    saved layout (a backbone rank: its own DP index where the saved layout had it). SystemExit when
    the layouts differ in more than data-parallel sizes."""
    for name in ("bb_pp", "enc_tp", "bb_tp", "gen_tp"):
        if getattr(saved, name) != getattr(layout, name):
            raise SystemExit(f"the checkpoint was saved with {name}={getattr(saved, name)}, this run has "
                             f"{getattr(layout, name)}: only data-parallel sizes may change on a restart")
    if (saved.enc_dp == 0) != (layout.enc_dp == 0) or (saved.gen_dp == 0) != (layout.gen_dp == 0):
        raise SystemExit("the checkpoint's encoder or generator placement (monolithic or not) differs from this run's")
    role, tp = layout.role(rank), layout.tp_rank(rank)
    if role[0] == "enc":
        return saved.enc_rank(0, tp)
    if role[0] == "gen":
        return saved.gen_rank(0, tp)
    dp = role[1] if role[1] < saved.bb_dp else 0  # its own data rank where it existed (the same data client)
    return saved.bb_rank(dp, role[2], tp)


def settle_layout(args, rank: int, world: int, start: int, control=None,
                  device: torch.device | None = None) -> tuple[PipelineLayout, CostConfig | None, list[float]]:
    """Rank 0 settles the layout and the measured costs (from the checkpoint at ``start`` if any,
    else by measuring and, with --orchestrate, planning) and broadcasts them; every rank sets them
    in ``args``. Returns (layout, costs or None, the broadcast vector the checkpoints keep)."""
    from trainer.orchestration.measure import Measured

    n = len(LAYOUT_FIELDS)
    vec = torch.zeros(n + 2 + Measured.SIZE, dtype=torch.float64)
    if rank == 0:
        elastic = start and saved_world(checkpoint_path(args.checkpoint_dir, start, 0).parent, world) != world
        saved = torch.load(checkpoint_path(args.checkpoint_dir, start, rank), weights_only=False,
                           map_location="cpu", mmap=True).get("orchestration") if start and not elastic else None
        if saved is not None:
            vec = torch.tensor(saved, dtype=torch.float64)
        else:
            vec = torch.tensor(_decide(args, world, device), dtype=torch.float64)
    dist.broadcast(vec, src=0, group=control)
    values = vec.tolist()
    for name, value in zip(LAYOUT_FIELDS, values):
        setattr(args, name, int(value))
    args.num_microbatches = int(values[n])
    cost = Measured.from_list(values[n + 2:]).cost_config() if values[n + 1] else None
    layout = runtime_layout(args)
    if layout.world_size != world:
        raise SystemExit(f"the layout needs {layout.world_size} processes, torchrun started {world}")
    return layout, cost, values


def _decide(args, world: int, device: torch.device | None = None) -> list[float]:
    from trainer.orchestration.measure import Measured, measure
    from trainer.orchestration.planner import search_exact

    measured = None
    if args.costs and args.costs.exists():
        try:
            measured = Measured.load(args.costs)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--costs: {exc}") from None
    elif args.profile_microbatches > 0 or args.orchestrate or args.costs:
        measured = measure(args.address, job_config(args), args.model_layers, max(args.profile_microbatches, 1),
                           device=device or "cpu", bf16=args.bf16, vocab_size=job_vocab_size(args))
        if device is not None and device.type == "cuda":
            torch.cuda.empty_cache()  # the probe model's memory goes back before the run's model is built
        if args.costs:
            measured.save(args.costs)
    if measured is not None:
        source = "loaded from --costs" if args.costs and args.costs.exists() else "measured"
        print(f"{source} per module (forward s per unit; backward factors): enc {measured.enc_s_per_token:.3g}/token "
              f"bb {measured.bb_s_per_token:.3g}/token gen {measured.gen_s_per_image:.3g}/image "
              f"bwd {tuple(round(f, 2) for f in measured.bwd_factor)}", flush=True)
    layout, microbatches = runtime_layout(args), args.num_microbatches
    if args.orchestrate:
        if args.global_batch < 1:
            raise SystemExit("--orchestrate needs --global-batch (sequences per step)")
        assert measured is not None
        plan = search_exact(measured.problem(world, args.global_batch, args.model_layers))
        if plan is None:
            raise SystemExit(f"no layout of exactly {world} processes fits --global-batch {args.global_batch} and "
                             f"--model-layers {args.model_layers}")
        layout, microbatches = plan.layout(), plan.num_microbatches
        print(f"orchestration: {plan.describe()}, {microbatches} microbatches, predicted "
              f"{plan.iteration_s:.3f} s per step", flush=True)
    zeros = [0.0] * Measured.SIZE
    return ([float(getattr(layout, f)) for f in LAYOUT_FIELDS] + [float(microbatches), float(measured is not None)]
            + (measured.as_list() if measured else zeros))


def init_distributed(args) -> tuple[torch.device, object]:
    """The process group (gloo on CPU; NCCL on GPUs, this process's GPU from LOCAL_RANK) and a gloo
    group for the small CPU-side control collectives (layout, step sizes, statistics)."""
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible to this process")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        if args.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (before its first use)
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
            torch.use_deterministic_algorithms(True, warn_only=True)  # index_copy, embedding backward, ...
        dist.init_process_group("nccl", device_id=device)
        return device, dist.new_group(backend="gloo")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    return torch.device("cpu"), None


def main(argv=None) -> int:
    args = parse(argv)
    device, control = init_distributed(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    start = latest_checkpoint(args.checkpoint_dir, world)
    layout, cost, settled = settle_layout(args, rank, world, start, control, device)
    # every rank creates every group, in the same order
    groups = {name: dist.new_group(ranks) for name, ranks in layout.groups().items()}
    groups.update({tuple(ranks): dist.new_group(ranks) for ranks in layout.tp_groups()})
    stage0 = dist.new_group(layout.groups()["bb0.tp0"], backend="gloo") if device.type != "cpu" else groups["bb0.tp0"]
    channels = Channels.create(device) if args.p2p_channels == "per-kind" else Channels.shared(device)
    sizes = {name: len(ranks) for name, ranks in layout.groups().items()}
    connect(channels, message_pairs(layout, args.num_microbatches), device)  # NCCL connects lazily: not in a step
    worker = build_worker(args, layout, rank, groups, cost, device, channels, stage0)
    if args.keys_log and getattr(worker, "client", None) is not None:
        args.keys_log.mkdir(parents=True, exist_ok=True)
        worker.keys_log = args.keys_log / f"bb{worker.dp}.keys"
    group = layout.group_of(rank)
    params = worker.parameters()
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    source = layout.bb_rank(0, 0)  # reads the first microbatch of every step
    traces = {}
    if start:
        saved = saved_layout(args.checkpoint_dir, start)
        loaded = rank if saved is None or saved == layout else source_rank(saved, layout, rank)
        # on the host: load_state_dict moves AdamW's moments to their parameters' device and keeps its
        # step counts on the host (on a GPU they would cost a sync each per parameter and step)
        state = torch.load(checkpoint_path(args.checkpoint_dir, start, loaded), weights_only=False,
                           map_location="cpu")
        for p, saved in zip(params, state["params"]):
            p.data.copy_(saved)
        optimizer.load_state_dict(state["optimizer"])
        if getattr(worker, "client", None) is not None:
            worker.client.load_state_dict(state["data"])  # another layout: continues the job's lineage
    counter = HostSyncCounter().install() if args.count_host_syncs else None
    counting = counter.counting if counter else contextlib.nullcontext
    for step in range(start, args.steps):
        began = time.perf_counter()
        # every rank runs the step's 1F1B over the number of microbatches the service planned for it
        num = torch.tensor([worker.peek_num_microbatches(step) if rank == source else 0])
        dist.broadcast(num, src=source, group=control)
        worker.begin_step(int(num.numpy()[0]))
        with counting(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            worker.run_step(step)
            worker.outbox.wait()
        traces[step] = {"num_microbatches": worker.M, "ops": worker.trace}
        reduce_gradients(params, groups[group], sizes[group])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with counting():
            loss_parts = worker.loss_parts.tolist()  # the step's one host sync: the device has finished it
        worker.finish_step()
        elapsed = time.perf_counter() - began
        syncs = counter.take() if counter else []
        if syncs and args.count_host_syncs and len(syncs) > 1:
            print(f"rank {rank} step {step}: {len(syncs)} host syncs: {syncs[:20]}", file=sys.stderr, flush=True)
        stats = torch.tensor([*loss_parts, elapsed, worker.busy_s, len(syncs)], dtype=torch.float64)
        gathered = [torch.zeros_like(stats) for _ in range(world)]
        dist.all_gather(gathered, stats, group=control)
        record = _record(step, layout, gathered)
        if rank == 0:
            _log(args, record)
        if args.feedback:
            _feed_back(worker, layout, step, record["bubble_mean"], control)
        if args.checkpoint_dir and (step + 1) % args.checkpoint_every == 0:
            _save(args, step + 1, rank, worker, params, optimizer, settled)
            dist.barrier(group=control)  # every rank's file is written: the checkpoint is complete
            if getattr(worker, "client", None) is not None:
                worker.client.acknowledge(step + 1)  # the service may drop the plans before it
    if args.save_params:
        args.save_params.mkdir(parents=True, exist_ok=True)
        torch.save({"role": layout.role(rank), "params": [p.detach() for p in params],
                    "shards": [getattr(p, "tp_shard", None) for p in params]}, args.save_params / f"rank{rank}.pt")
    if args.trace:
        _write_trace(args.trace, rank, layout, worker, traces)
    if getattr(worker, "client", None) is not None:
        worker.client.close()
    dist.barrier(group=control)
    dist.destroy_process_group()
    return 0


def _write_trace(directory: Path, rank: int, layout: PipelineLayout, worker, traces: dict) -> None:
    """What this rank ran: its role, the layout, the ops of every step; a data-reading rank adds the
    pipeline the service planned for (its JobInfo)."""
    record = {"rank": rank, "role": list(layout.role(rank)), "tp_rank": layout.tp_rank(rank),
              "layout": {f: getattr(layout, f) for f in LAYOUT_FIELDS}, "steps": traces,
              "sent": sorted([kind, dst] for kind, dst in worker.outbox.sent)}
    client = getattr(worker, "client", None)
    if client is not None:
        spec = client.info.spec
        record["job"] = {"job_id": client.job_id, "stage_map": list(spec.stage_map),
                         "enc_shared_by": spec.enc_shared_by, "gen_shared_by": spec.gen_shared_by,
                         "enc_split_by": spec.enc_split_by, "gen_split_by": spec.gen_split_by,
                         "cost": {f.name: v for f, v in spec.cost.ListFields()}}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"rank{rank}.json").write_text(json.dumps(record))


def _feed_back(worker, layout: PipelineLayout, step: int, bubble: float, control=None) -> None:
    """Gathers every rank's per-microbatch busy seconds into [bb_dp, M, module]; each chain's
    stage 0 reports its row to the service, which refits its cost model. A TP group counts
    once (its leader's time)."""
    table = torch.zeros(layout.bb_dp, worker.M, 3, dtype=torch.float64)
    for (d, m), seconds in worker.per_microbatch.items():
        if worker.tp.leader:
            table[d, m, worker.module_index] += seconds
    dist.all_reduce(table, group=control)
    if getattr(worker, "client", None) is not None:
        worker.client.report_timings([(step, m, *table[worker.dp, m].tolist()) for m in range(worker.M)],
                                     bubble=(step, bubble))


def _save(args, step: int, rank: int, worker, params, optimizer, settled: list[float]) -> None:
    path = checkpoint_path(args.checkpoint_dir, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    if rank == 0:  # what a restart with another number of processes maps its ranks from
        layout = {name: int(getattr(args, name)) for name in LAYOUT_FIELDS}
        (path.parent / "layout.json").write_text(json.dumps({**layout, "world": int(dist.get_world_size())}))
    state = {"params": [p.detach() for p in params], "optimizer": optimizer.state_dict(), "orchestration": settled}
    if getattr(worker, "client", None) is not None:
        state["data"] = worker.client.state_dict()
    torch.save(state, str(path) + ".tmp")
    os.replace(str(path) + ".tmp", path)


def _record(step: int, layout: PipelineLayout, gathered: list[torch.Tensor]) -> dict:
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
            "bubble_mean": 1 - float(rows[:, 3].sum()) / (step_s * layout.world_size),
            "host_syncs_max": int(rows[:, 4].max())}


def _log(args, record: dict) -> None:
    step, loss, step_s, bubble = record["step"], record["loss"], record["step_s"], record["bubble"]
    print(f"step {step:4d}  loss {loss:8.4f}  {step_s:6.2f} s  bubble " +
          " ".join(f"{k} {v:4.0%}" for k, v in bubble.items()), flush=True)
    if args.log_json:
        with open(args.log_json, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    sys.exit(main())
