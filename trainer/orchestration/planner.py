"""Orchestration planner: how many GPUs (or CPU processes) and which parallelism each module gets.

Disaggregated layout: the encoder runs as its own group (DP_e replicas of TP_e), the backbone as
DP_b x TP_b x PP stages, the generator as its own group (DP_g x TP_g). Every backbone DP rank
streams M = global_batch / (DP_b * S) microbatches through the pipeline
encoder -> backbone stage 1..PP -> generator; the encoder and generator groups serve all DP_b
ranks, so each of their microbatch slots carries DP_b / DP_e (DP_b / DP_g) microbatches. DP_e
divides DP_b or is a multiple of it (disttrain_api.layout.PipelineLayout); k = DP_e / DP_b
replicas per rank take turns, counted as 1/k of a microbatch per slot (their throughput).
Partly disaggregated: only the encoder (or only the generator) runs as its own group, the other
inside the backbone's last (first) stage; ``search_exact`` considers these too (on a 2-process
world they are the only disaggregated layouts).

Monolithic layout (Megatron-like): one DP x TP x PP grid; the encoder runs inside the first
pipeline stage and the generator inside the last, at the backbone's TP, and the backbone's layers
are split evenly over the stages.

Iteration time (1F1B) = the first microbatch's forward and backward through every stage
+ (M - 1) x the slowest stage's forward + backward + the gradient all-reduce of the slowest group.
Memory per GPU = weights, gradients, Adam states (sharded over DP) + activations of the
microbatches in flight at that stage (min(M, stages - stage index) in 1F1B).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from disttrain_api.layout import PipelineLayout
from trainer.orchestration.profile import Accelerator, Content, ModuleProfile

TP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True, slots=True)
class Parallel:
    dp: int
    tp: int
    pp: int = 1

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass(slots=True)
class Plan:
    """A layout and what the model predicts for it."""

    kind: str
    """"disaggregated" or "monolithic"."""
    enc: Parallel
    bb: Parallel
    gen: Parallel
    num_microbatches: int
    stage_s: list[float]
    """Forward + backward seconds of one microbatch slot per pipeline stage, first to last."""
    iteration_s: float
    gpus: int
    peak_memory_bytes: float
    throughput: float = 0.0
    """Sequences per second."""
    mfu: float = 0.0
    notes: dict = field(default_factory=dict)

    def layout(self) -> PipelineLayout:
        """The runtime's and the service's layout of this plan (disttrain_api.layout)."""
        if self.kind == "monolithic":
            return PipelineLayout(0, self.bb.dp, self.bb.pp, 0, 1, self.bb.tp, 1)
        return PipelineLayout(self.enc.dp, self.bb.dp, self.bb.pp, self.gen.dp, self.enc.tp, self.bb.tp, self.gen.tp)

    def describe(self) -> str:
        if self.kind == "monolithic":
            return f"DP{self.bb.dp} x TP{self.bb.tp} x PP{self.bb.pp} (enc in stage 1, gen in stage {self.bb.pp})"
        enc = f"enc DP{self.enc.dp} x TP{self.enc.tp}" if self.enc.dp else "enc in bb stage 1"
        gen = f"gen DP{self.gen.dp} x TP{self.gen.tp}" if self.gen.dp else f"gen in bb stage {self.bb.pp}"
        return f"{enc} | bb DP{self.bb.dp} x TP{self.bb.tp} x PP{self.bb.pp} | {gen}"


@dataclass(frozen=True, slots=True)
class Problem:
    """What to plan for."""

    encoder: ModuleProfile
    backbone: ModuleProfile
    generator: ModuleProfile
    content: Content
    """One microbatch (S sequences) as it averages over the global batch."""
    global_batch: int
    """Sequences per step."""
    seqs_per_microbatch: int
    num_gpus: int
    accelerator: Accelerator
    backbone_layers: int
    p2p_s: float = 0.0
    """Latency of one pipeline send between stages."""


def allreduce_s(problem: Problem, params_per_gpu: float, dp: int) -> float:
    if dp == 1:
        return 0.0
    return 2 * (dp - 1) / dp * params_per_gpu * 2 / problem.accelerator.dp_link_bytes_s


def _pipeline_s(stages: list[float], num_microbatches: int, p2p_s: float) -> float:
    return sum(stages) + (num_microbatches - 1) * max(stages) + 2 * (len(stages) - 1) * p2p_s


def _fb(profile: ModuleProfile, content: Content, tp: int, share: float = 1.0) -> float:
    return profile.fwd_s(content, tp, share) + profile.bwd_s(content, tp, share)


def _finish(problem: Problem, plan: Plan) -> Plan:
    plan.throughput = problem.global_batch / plan.iteration_s
    microbatches = problem.global_batch / problem.seqs_per_microbatch
    flops = microbatches * sum(p.flops(problem.content) for p in (problem.encoder, problem.backbone, problem.generator))
    plan.mfu = flops / (plan.iteration_s * plan.gpus * problem.accelerator.peak_flops)
    return plan


def disaggregated(problem: Problem, enc: Parallel, bb: Parallel, gen: Parallel) -> Plan | None:
    """The plan of one disaggregated layout, or None if it does not fit (GPUs, batch, memory).

    ``enc.dp == 0`` (``gen.dp == 0``) keeps the encoder (generator) inside the backbone's first
    (last) stage at the backbone's TP, as the monolithic layout does: a partly disaggregated
    layout (PipelineLayout's ``enc_dp = 0`` / ``gen_dp = 0``). Both 0 is ``monolithic``'s."""
    c, M = problem.content, problem.global_batch // (bb.dp * problem.seqs_per_microbatch)
    if (not (enc.dp or gen.dp) or enc.gpus + bb.gpus + gen.gpus > problem.num_gpus
            or problem.global_batch % (bb.dp * problem.seqs_per_microbatch)
            or problem.backbone_layers % bb.pp or max(enc.tp, bb.tp, gen.tp) > problem.accelerator.max_tp
            or (enc.dp and bb.dp % enc.dp and enc.dp % bb.dp) or (gen.dp and bb.dp % gen.dp and gen.dp % bb.dp)):
        return None  # a replica serves whole backbone DP ranks, or each has k replicas (PipelineLayout)
    share = 1 / bb.pp
    inner = [_fb(problem.backbone, c, bb.tp, share)] * bb.pp
    if not enc.dp:
        inner[0] += _fb(problem.encoder, c, bb.tp)
    if not gen.dp:
        inner[-1] += _fb(problem.generator, c, bb.tp)
    stages = ([bb.dp / enc.dp * _fb(problem.encoder, c, enc.tp)] if enc.dp else []) + inner
    stages += [bb.dp / gen.dp * _fb(problem.generator, c, gen.tp)] if gen.dp else []
    n, first = len(stages), 1 if enc.dp else 0
    memory = [problem.encoder.memory_bytes(c, enc.tp, 1.0, math.ceil(min(M, n) * bb.dp / enc.dp), enc.dp)] if enc.dp \
        else []
    for i in range(bb.pp):
        in_flight = min(M, n - first - i)
        m = problem.backbone.memory_bytes(c, bb.tp, share, in_flight, bb.dp)
        if i == 0 and not enc.dp:
            m += problem.encoder.memory_bytes(c, bb.tp, 1.0, in_flight, bb.dp)
        if i == bb.pp - 1 and not gen.dp:
            m += problem.generator.memory_bytes(c, bb.tp, 1.0, in_flight, bb.dp)
        memory.append(m)
    if gen.dp:
        memory.append(problem.generator.memory_bytes(c, gen.tp, 1.0, math.ceil(bb.dp / gen.dp), gen.dp))
    if max(memory) > problem.accelerator.memory_bytes:
        return None
    stage_params = [problem.backbone.params * share] * bb.pp
    stage_params[0] += 0 if enc.dp else problem.encoder.params
    stage_params[-1] += 0 if gen.dp else problem.generator.params
    sync = max(allreduce_s(problem, problem.encoder.params / enc.tp, enc.dp) if enc.dp else 0.0,
               allreduce_s(problem, max(stage_params) / bb.tp, bb.dp),
               allreduce_s(problem, problem.generator.params / gen.tp, gen.dp) if gen.dp else 0.0)
    iteration = _pipeline_s(stages, M, problem.p2p_s) + sync
    return _finish(problem, Plan("disaggregated", enc, bb, gen, M, stages, iteration,
                                 enc.gpus + bb.gpus + gen.gpus, max(memory)))


def monolithic(problem: Problem, grid: Parallel) -> Plan | None:
    """The Megatron-like layout on one DP x TP x PP grid, or None if it does not fit."""
    c, tp, pp = problem.content, grid.tp, grid.pp
    M = problem.global_batch // (grid.dp * problem.seqs_per_microbatch) if grid.dp else 0
    if (grid.gpus > problem.num_gpus or not M or problem.global_batch % (grid.dp * problem.seqs_per_microbatch)
            or problem.backbone_layers % pp or tp > problem.accelerator.max_tp):
        return None
    share = 1 / pp
    stages = [_fb(problem.backbone, c, tp, share) for _ in range(pp)]
    stages[0] += _fb(problem.encoder, c, tp)
    stages[-1] += _fb(problem.generator, c, tp)
    memory = []
    for i in range(pp):
        in_flight = min(M, pp - i)
        m = problem.backbone.memory_bytes(c, tp, share, in_flight, grid.dp)
        if i == 0:
            m += problem.encoder.memory_bytes(c, tp, 1.0, in_flight, grid.dp)
        if i == pp - 1:
            m += problem.generator.memory_bytes(c, tp, 1.0, in_flight, grid.dp)
        memory.append(m)
    if max(memory) > problem.accelerator.memory_bytes:
        return None
    first_params = problem.backbone.params * share + problem.encoder.params
    sync = allreduce_s(problem, first_params / tp, grid.dp)
    iteration = _pipeline_s(stages, M, problem.p2p_s) + sync
    return _finish(problem, Plan("monolithic", grid, grid, grid, M, stages, iteration, grid.gpus, max(memory)))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _grids(problem: Problem):
    """Every backbone grid: TP x PP (dividing the layers) x DP (dividing the microbatches)."""
    for tp in TP_SIZES:
        for pp in _divisors(problem.backbone_layers):
            for dp in _divisors(problem.global_batch // problem.seqs_per_microbatch):
                yield Parallel(dp, tp, pp)


def search_monolithic(problem: Problem) -> Plan | None:
    """The fastest monolithic grid."""
    best = None
    for grid in _grids(problem):
        plan = monolithic(problem, grid)
        if plan and (best is None or plan.iteration_s < best.iteration_s):
            best = plan
    return best


def search_disaggregated(problem: Problem) -> Plan | None:
    """The fastest disaggregated layout: every backbone grid, every encoder/generator TP, and the
    split of the remaining GPUs between encoder and generator that balances their stages."""
    best = None
    c = problem.content
    for bb in _grids(problem):
        dp, left = bb.dp, problem.num_gpus - bb.gpus
        if left < 2:
            continue
        for enc_tp in TP_SIZES:
            for gen_tp in TP_SIZES:
                a, b = dp * _fb(problem.encoder, c, enc_tp), dp * _fb(problem.generator, c, gen_tp)
                ideal = left * a / (a * enc_tp + b * gen_tp)  # enc replicas with a/x == b/y
                # one replica serves whole backbone DP ranks, or each rank has k replicas
                replicas = _divisors(dp) + [dp * k for k in range(2, left // dp + 1)]
                below = [r for r in replicas if r <= ideal]
                for enc_dp in {below[-1] if below else 1, next((r for r in replicas if r >= ideal), dp)}:
                    fits = [r for r in replicas if r * gen_tp <= left - enc_dp * enc_tp]
                    if not fits:
                        continue
                    plan = disaggregated(problem, Parallel(enc_dp, enc_tp), bb, Parallel(fits[-1], gen_tp))
                    if plan and (best is None or plan.iteration_s < best.iteration_s):
                        best = plan
    return best


def search_exact(problem: Problem, kind: str | None = None) -> Plan | None:
    """The fastest layout that uses exactly ``num_gpus`` processes (a torchrun world): every
    monolithic grid and every disaggregated split of it, partly disaggregated ones included (the
    encoder or the generator inside the backbone); ``kind`` ("monolithic", "disaggregated") keeps
    only that kind. Exhaustive: for small worlds."""
    best = None
    n = problem.num_gpus
    for bb in _grids(problem):
        dp = bb.dp
        if bb.gpus > n:
            continue
        candidates = [monolithic(problem, bb)] if bb.gpus == n else []
        for enc_dp in [0] + _divisors(dp) + [dp * k for k in range(2, n // dp + 1)]:
            for enc_tp in TP_SIZES if enc_dp else (1,):
                left = n - bb.gpus - enc_dp * enc_tp
                if left == 0 and enc_dp:
                    candidates.append(disaggregated(problem, Parallel(enc_dp, enc_tp), bb, Parallel(0, 1)))
                for gen_tp in TP_SIZES if left > 0 else ():
                    gen_dp = left // gen_tp
                    if left % gen_tp == 0 and (dp % gen_dp == 0 or gen_dp % dp == 0):
                        candidates.append(disaggregated(problem, Parallel(enc_dp, enc_tp), bb,
                                                        Parallel(gen_dp, gen_tp)))
        for plan in candidates:
            if (plan and plan.gpus == n and kind in (None, plan.kind)
                    and (best is None or plan.iteration_s < best.iteration_s)):
                best = plan
    return best
