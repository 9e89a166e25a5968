"""Exact simulator of a non-interleaved 1F1B pipeline schedule, and the stage model it runs on.

A rank's pipeline has P stages and runs M microbatches. Stage s executes, in this order:
warm-up forwards F(0..w-1) with w = min(P - s - 1, M); then the steady phase F(w+i), B(i) for
i < M - w; then the cool-down backwards B(M-w..M-1). Each op starts when the previous op of its
stage has finished and its data is there: F(s, m) needs F(s-1, m) (plus the p2p latency), B(s, m)
needs B(s+1, m) (plus latency), and B(P-1, m) needs F(P-1, m). The makespan is the end of the last
op. Ranks of a data-parallel group meet only at the gradient all-reduce, so an iteration takes as
long as the slowest rank's makespan (``iteration_time``).

Stages map to modules by a list such as ``["enc", "bb/2", "bb/2", "gen"]``: ``mod/k`` is 1/k of
the module's time. Module times per microbatch are forward seconds; backward = forward * factor.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

MODULES = ("enc", "bb", "gen")


@dataclass(frozen=True, slots=True)
class StageModel:
    """Which module (and what share of it) each pipeline stage runs, and backward factors."""

    stage_map: tuple[str, ...]
    bwd_factor: tuple[float, float, float] = (2.0, 2.0, 2.0)
    """Backward / forward time of enc, bb, gen (0 for a frozen module)."""
    p2p_latency: float = 0.0
    """Seconds between an op's end on one stage and the dependent op's start on the next."""

    def __post_init__(self) -> None:
        for entry in self.stage_map:
            module, _, share = entry.partition("/")
            if module not in MODULES or (share and (not share.isdigit() or int(share) < 1)):
                raise ValueError(f"stage {entry!r} is not 'MODULE' or 'MODULE/K' with MODULE in {MODULES} "
                                 "and K a positive integer")

    @property
    def num_stages(self) -> int:
        return len(self.stage_map)

    def weights(self) -> np.ndarray:
        """float[P, 3]: share of each module's time that each stage runs."""
        out = np.zeros((self.num_stages, len(MODULES)))
        for s, entry in enumerate(self.stage_map):
            module, _, share = entry.partition("/")
            out[s, MODULES.index(module)] = 1.0 / int(share or 1)
        return out

    def stage_times(self, module_fwd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """module_fwd float[M, 3] (enc, bb, gen forward seconds per microbatch) -> (fwd, bwd) float[P, M]."""
        weights = self.weights()
        fwd = weights @ module_fwd.T
        bwd = weights @ (module_fwd * np.asarray(self.bwd_factor)).T
        return fwd, bwd


@dataclass(slots=True)
class Timeline:
    """Start and end of every op: float[P, M] each for forwards and backwards."""

    f_start: np.ndarray
    f_end: np.ndarray
    b_start: np.ndarray
    b_end: np.ndarray

    @property
    def makespan(self) -> float:
        return float(max(self.f_end.max(initial=0.0), self.b_end.max(initial=0.0)))


def stage_order(P: int, M: int, stage: int) -> list[tuple[str, int]]:
    """The op sequence of one stage: ('F' | 'B', microbatch)."""
    warmup = min(P - stage - 1, M)
    ops = [("F", m) for m in range(warmup)]
    for i in range(M - warmup):
        ops += [("F", warmup + i), ("B", i)]
    ops += [("B", m) for m in range(M - warmup, M)]
    return ops


def simulate_1f1b(fwd: np.ndarray, bwd: np.ndarray, p2p_latency: float = 0.0) -> Timeline:
    """Exact 1F1B timeline for per-stage, per-microbatch forward and backward times (float[P, M])."""
    fwd, bwd = np.asarray(fwd, dtype=float), np.asarray(bwd, dtype=float)
    P, M = fwd.shape
    nan = np.full((P, M), np.nan)
    t = Timeline(nan.copy(), nan.copy(), nan.copy(), nan.copy())
    orders = [stage_order(P, M, s) for s in range(P)]
    cursor, free_at = [0] * P, [0.0] * P
    remaining = 2 * P * M
    while remaining:
        progressed = False
        for s in range(P):
            while cursor[s] < len(orders[s]):
                ready = _ready_time(t, orders[s][cursor[s]], s, P, p2p_latency)
                if ready is None:
                    break
                kind, m = orders[s][cursor[s]]
                start = max(free_at[s], ready)
                end = start + (fwd[s, m] if kind == "F" else bwd[s, m])
                if kind == "F":
                    t.f_start[s, m], t.f_end[s, m] = start, end
                else:
                    t.b_start[s, m], t.b_end[s, m] = start, end
                free_at[s] = end
                cursor[s] += 1
                remaining -= 1
                progressed = True
        assert progressed, "1F1B dependency cycle: the schedule is malformed"
    return t


def _ready_time(t: Timeline, op: tuple[str, int], s: int, P: int, latency: float) -> float | None:
    """When the op's input is available, or None if its producer has not been scheduled yet."""
    kind, m = op
    if kind == "F":
        if s == 0:
            return 0.0
        done = t.f_end[s - 1, m]
        return None if np.isnan(done) else done + latency
    if s == P - 1:
        done = t.f_end[s, m]
        return None if np.isnan(done) else done
    done = t.b_end[s + 1, m]
    return None if np.isnan(done) else done + latency


@lru_cache(maxsize=64)
def _topological_order(P: int, M: int) -> tuple[tuple[str, int, int], ...]:
    """A valid execution order of all ops ('F' | 'B', stage, microbatch) of a P x M 1F1B schedule.
    The order in which the exact simulator schedules ops depends only on the dependency structure,
    not on durations, so it is computed once per (P, M) with unit times."""
    t = simulate_1f1b(np.ones((P, M)), np.ones((P, M)))
    ops = [(t.f_start[s, m], 0, s, "F", m) for s in range(P) for m in range(M)]
    ops += [(t.b_start[s, m], 1, s, "B", m) for s in range(P) for m in range(M)]
    # Ties in start time never link dependent ops (a dependent op starts strictly later).
    return tuple((kind, s, m) for _, _, s, kind, m in sorted(ops))


def makespans(fwd: np.ndarray, bwd: np.ndarray, p2p_latency: float = 0.0) -> np.ndarray:
    """Makespan of many independent pipelines at once: fwd, bwd float[R, P, M] -> float[R].

    Same schedule and dependencies as simulate_1f1b (the tests check they agree), vectorised over
    the R pipelines so a planner can afford it inside a search loop."""
    fwd, bwd = np.asarray(fwd, dtype=float), np.asarray(bwd, dtype=float)
    R, P, M = fwd.shape
    f_end, b_end = np.zeros((R, P, M)), np.zeros((R, P, M))
    free = np.zeros((R, P))
    for kind, s, m in _topological_order(P, M):
        if kind == "F":
            ready = f_end[:, s - 1, m] + p2p_latency if s > 0 else 0.0
            end = np.maximum(free[:, s], ready) + fwd[:, s, m]
            f_end[:, s, m] = end
        else:
            ready = f_end[:, s, m] if s == P - 1 else b_end[:, s + 1, m] + p2p_latency
            end = np.maximum(free[:, s], ready) + bwd[:, s, m]
            b_end[:, s, m] = end
        free[:, s] = end
    return free.max(axis=1)


def rank_makespan(module_fwd: np.ndarray, model: StageModel) -> float:
    """Makespan of one rank running microbatches with module forward times float[M, 3], in that order."""
    fwd, bwd = model.stage_times(module_fwd)
    return simulate_1f1b(fwd, bwd, model.p2p_latency).makespan


def iteration_time(module_fwd_per_rank: list[np.ndarray], model: StageModel) -> float:
    """Ranks meet only at the gradient all-reduce: the iteration takes the slowest rank's makespan."""
    return max(rank_makespan(mb, model) for mb in module_fwd_per_rank)
