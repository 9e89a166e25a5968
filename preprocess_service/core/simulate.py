"""Exact simulator of a non-interleaved 1F1B pipeline schedule, and the stage model it runs on.

A rank's pipeline has P stages and runs M microbatches. Stage s executes, in this order:
warm-up forwards F(0..w-1) with w = min(P - s - 1, M); then the steady phase F(w+i), B(i) for
i < M - w; then the cool-down backwards B(M-w..M-1). Each op starts when the previous op of its
stage has finished and its data is there: F(s, m) needs F(s-1, m) (plus the p2p latency), B(s, m)
needs B(s+1, m) (plus latency), and B(P-1, m) needs F(P-1, m). The makespan is the end of the last
op.

Stages map to modules by a list such as ``["enc", "bb/2", "bb/2", "gen"]``: ``mod/k`` is 1/k of
the module's time. Module times per microbatch are forward seconds; backward = forward * factor.

How ranks synchronise (the objective the planner minimises, ``StageModel.shared_by``):

* **independent ranks** (shared_by 1 for every module; a monolithic layout, or disaggregated
  modules with as many replicas as backbone DP ranks): every DP rank runs its own pipeline and the
  ranks meet only at the gradient all-reduce, so the iteration takes the slowest rank's makespan,
  and only each rank's sequences and microbatch order matter.
* **split stages** (more encoder or generator replicas than backbone DP ranks: k per rank,
  ``StageModel.split_by``): rank d's microbatch m runs on its replica m % k, so the stage's ops of
  different replicas overlap; the ranks stay independent.
* **coupled ranks** (a disaggregated encoder or generator with fewer replicas than backbone DP
  ranks; shared_by = g means one replica serves g consecutive backbone ranks): the shared stage
  runs microbatch m of its g ranks as one op, once all their inputs are there, for the sum of their
  times, and each of them waits for it. A microbatch slot then couples those ranks: the
  component of ranks linked by shared stages (lcm of the g's) is simulated as one, and the
  iteration takes the slowest component's makespan.

The reference simulator here (``simulate_coupled``, ``simulate_1f1b``) is written for reading and
returns the whole timeline; simkernels.py has the compiled version the planner runs thousands of
times, and the tests check that both agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import cast

import numpy as np

from disttrain_api.layout import StageModel, stage_order
from preprocess_service.core import simkernels


@dataclass(slots=True)
class Timeline:
    """Start and end of every op: float[P, M] each for forwards and backwards (float[L, P, M] for the
    L ranks of a coupled component)."""

    f_start: np.ndarray
    f_end: np.ndarray
    b_start: np.ndarray
    b_end: np.ndarray

    @property
    def makespan(self) -> float:
        return float(max(self.f_end.max(initial=0.0), self.b_end.max(initial=0.0)))


def simulate_1f1b(fwd: np.ndarray, bwd: np.ndarray, p2p_latency: float = 0.0) -> Timeline:
    """Exact 1F1B timeline of one rank from per-stage, per-microbatch forward and backward times
    (float[P, M])."""
    fwd, bwd = np.asarray(fwd, dtype=float), np.asarray(bwd, dtype=float)
    t = simulate_coupled(fwd[None], bwd[None], np.ones(fwd.shape[0], dtype=int), p2p_latency)
    return Timeline(t.f_start[0], t.f_end[0], t.b_start[0], t.b_end[0])


def simulate_coupled(fwd: np.ndarray, bwd: np.ndarray, groups, p2p_latency: float = 0.0, splits=None) -> Timeline:
    """Exact 1F1B timeline of L ranks (fwd, bwd float[L, P, M]) whose stage s is run by one replica
    per ``groups[s]`` consecutive ranks: that replica's op (kind, s, m) starts once its previous op
    is done and the inputs of all its ranks are there, and lasts the sum of their times. With
    ``splits[s] = k > 1`` (groups[s] must be 1) each rank has k replicas of stage s and replica j
    runs the ops of the microbatches m with m % k == j, in the stage's order.

    Event-driven: every replica repeatedly runs the next op of its stage order whose inputs are
    ready, until all are scheduled (no precomputed order, so it checks the compiled kernels)."""
    fwd, bwd = np.asarray(fwd, dtype=float), np.asarray(bwd, dtype=float)
    L, P, M = fwd.shape
    groups = [int(g) for g in groups]
    splits = [1] * P if splits is None else [int(k) for k in splits]
    if len(groups) != P or any(g < 1 or L % g for g in groups):
        raise ValueError(f"groups {groups} must give, for each of the {P} stages, a divisor of {L} ranks")
    if len(splits) != P or any(k < 1 or (k > 1 and g > 1) for k, g in zip(splits, groups)):
        raise ValueError(f"splits {splits} must give a positive count per stage, 1 where a stage is shared")
    nan = np.full((L, P, M), np.nan)
    t = Timeline(nan.copy(), nan.copy(), nan.copy(), nan.copy())
    replicas = [(s, j0, j) for s in range(P) for j0 in range(0, L, groups[s]) for j in range(splits[s])]
    orders = {(s, j): [(kind, m) for kind, m in stage_order(P, M, s) if m % splits[s] == j]
              for s in range(P) for j in range(splits[s])}
    cursor = {rep: 0 for rep in replicas}
    free_at = {rep: 0.0 for rep in replicas}
    remaining = sum(len(orders[s, j]) for s, _, j in replicas)
    while remaining:
        progressed = False
        for rep in replicas:
            s, j0, j = rep
            members = range(j0, j0 + groups[s])
            order = orders[s, j]
            while cursor[rep] < len(order):
                kind, m = order[cursor[rep]]
                inputs = [_ready_time(t, kind, r, s, m, P, p2p_latency) for r in members]
                if any(x is None for x in inputs):
                    break
                start = max(free_at[rep], *cast(list[float], inputs))  # none is None (checked above)
                times = fwd if kind == "F" else bwd
                end = start + sum(times[r, s, m] for r in members)
                for r in members:
                    if kind == "F":
                        t.f_start[r, s, m], t.f_end[r, s, m] = start, end
                    else:
                        t.b_start[r, s, m], t.b_end[r, s, m] = start, end
                free_at[rep] = end
                cursor[rep] += 1
                remaining -= 1
                progressed = True
        assert progressed, "1F1B dependency cycle: the schedule is malformed"
    return t


def replica_ops(model: StageModel, fwd: np.ndarray,
                bwd: np.ndarray) -> dict[tuple[int, int], list[tuple[str, int, int]]]:
    """The simulator's prediction of who runs what: for every (stage, replica) the ops (kind, rank,
    microbatch) in the order of their simulated start (ranks of one shared op in rank order), from
    the reference simulation of D ranks' stage times fwd, bwd float[D, P, M]. Replicas are numbered
    as disttrain_api.layout numbers them: rank // g when g ranks share one, rank * k + m % k when
    each rank has k."""
    D, P, M = np.shape(fwd)
    groups, splits = model.stage_groups(), model.stage_splits()
    t = simulate_coupled(fwd, bwd, groups, model.p2p_latency, splits)
    out: dict[tuple[int, int], list[tuple[float, int, str, int, int]]] = {}
    for s in range(P):
        for r in range(D):
            for m in range(M):
                replica = r // int(groups[s]) if splits[s] == 1 else r * int(splits[s]) + m % int(splits[s])
                for kind, start in (("F", t.f_start[r, s, m]), ("B", t.b_start[r, s, m])):
                    out.setdefault((s, replica), []).append((float(start), r, kind, r, m))
    return {key: [(kind, r, m) for _, _, kind, r, m in sorted(ops)] for key, ops in out.items()}


def _ready_time(t: Timeline, kind: str, r: int, s: int, m: int, P: int, latency: float) -> float | None:
    """When rank r's input of op (kind, s, m) is available, or None if its producer is not scheduled."""
    if kind == "F":
        if s == 0:
            return 0.0
        done = t.f_end[r, s - 1, m]
        return None if np.isnan(done) else done + latency
    if s == P - 1:
        done = t.f_end[r, s, m]
        return None if np.isnan(done) else done
    done = t.b_end[r, s + 1, m]
    return None if np.isnan(done) else done + latency


@lru_cache(maxsize=64)
def topological_order(P: int, M: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A valid execution order of all ops of a P x M 1F1B schedule as int arrays (kind 0 = F / 1 = B,
    stage, microbatch). The order in which the exact simulator schedules ops depends only on the
    dependency structure, not on durations, so it is computed once per (P, M) with unit times.
    Coupling joins only ops of the same (kind, stage, microbatch), so the order serves coupled
    components too."""
    t = simulate_1f1b(np.ones((P, M)), np.ones((P, M)))
    ops = [(t.f_start[s, m], 0, s, m) for s in range(P) for m in range(M)]
    ops += [(t.b_start[s, m], 1, s, m) for s in range(P) for m in range(M)]
    # Ties in start time never link dependent ops (a dependent op starts strictly later).
    ops.sort()
    kinds, stages, mbs = (np.array([op[i] for op in ops], dtype=np.int64) for i in (1, 2, 3))
    return kinds, stages, mbs


def component_makespans(fwd: np.ndarray, bwd: np.ndarray, model: StageModel) -> np.ndarray:
    """Makespan of every coupled component: fwd, bwd float[D, P, M] per-rank stage times in execution
    order -> float[D / model.component] (compiled kernel; equal to simulate_coupled)."""
    fwd = np.ascontiguousarray(fwd, dtype=float)
    bwd = np.ascontiguousarray(bwd, dtype=float)
    D, P, M = fwd.shape
    model.check_ranks(D)
    return simkernels.component_spans(fwd, bwd, model.component, model.kernel_groups(),
                                      *topological_order(P, M), float(model.p2p_latency))


def makespans(fwd: np.ndarray, bwd: np.ndarray, p2p_latency: float = 0.0) -> np.ndarray:
    """Makespan of many independent pipelines at once: fwd, bwd float[R, P, M] -> float[R]."""
    fwd = np.ascontiguousarray(fwd, dtype=float)
    R, P, M = fwd.shape
    return simkernels.component_spans(fwd, np.ascontiguousarray(bwd, dtype=float), 1, np.ones(P, dtype=np.int64),
                                      *topological_order(P, M), float(p2p_latency))


def rank_makespan(module_fwd: np.ndarray, model: StageModel) -> float:
    """Makespan of one rank running microbatches with module forward times float[M, 3], in that order."""
    fwd, bwd = model.stage_times(module_fwd)
    return simulate_1f1b(fwd, bwd, model.p2p_latency).makespan


def iteration_time(module_fwd_per_rank: list[np.ndarray], model: StageModel) -> float:
    """Iteration time of D ranks (module forward times float[M, 3] each, in execution order): the
    slowest component's makespan (ranks coupled by shared stages run as one; module docstring)."""
    fwd, bwd = zip(*(model.stage_times(mb) for mb in module_fwd_per_rank))
    return float(component_makespans(np.stack(fwd), np.stack(bwd), model).max())
