"""An independent reference for the whole-batch planner: its own 1F1B simulator and exact optima of
small instances (reference_search.py adds a time-boxed search whose moves differ from ``ours``).

It shares no code with the planner: it imports neither preprocess_service nor disttrain_api and
reads only the instance's JSON form (``disttrain-reorder-instance/1``, Instance.to_json()), so a bug
in the planner's simulator, stage model or moves cannot hide in both. Plans are int[D, M, S]
sequence ids, microbatches in each rank's execution order, as the planner's.

Scope: independent ranks only (``shared_by`` 1 for enc and gen, the JSON's default): every rank runs
its own pipeline and the iteration takes the slowest rank's makespan. Instances with a shared
encoder or generator are refused (ValueError).

The schedule, from its definition (non-interleaved 1F1B, P stages, M microbatches): stage s first
runs w = min(P - s - 1, M) warm-up forwards, then alternates one forward and one backward until
every forward has run, then runs the remaining backwards. An op starts when the stage is free and
its input is there: forward (s, m) after forward (s - 1, m) has ended plus the p2p latency (s > 0);
backward (s, m) after backward (s + 1, m) plus the latency, or, on the last stage, right after
forward (P - 1, m). A microbatch's stage time is the sum of its sequences' (each module's forward
seconds times the stage's share of the module; backward = forward x the module's factor). A
rank's makespan is the end of its last op.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numba as nb
import numpy as np

MODULES = ("enc", "bb", "gen")


@dataclass(frozen=True)
class RefInstance:
    """What the reference reads from an instance's JSON: seq_fwd, seq_bwd float[P, B] per-sequence
    stage seconds (sequence ids as in the JSON), p2p latency in seconds."""

    D: int
    M: int
    S: int
    seq_fwd: np.ndarray
    seq_bwd: np.ndarray
    latency: float

    @property
    def P(self) -> int:
        return int(self.seq_fwd.shape[0])


def load_instance(data: dict) -> RefInstance:
    """Parses ``disttrain-reorder-instance/1`` (stage entries 'mod', 'mod/k' or parts joined by '+')."""
    if data.get("format") != "disttrain-reorder-instance/1":
        raise ValueError(f"not a reorder instance: format {data.get('format')!r}")
    shared = data.get("shared_by", {})
    if any(int(g) != 1 for g in shared.values()):
        raise ValueError(f"the reference handles independent ranks only (shared_by 1), got {shared}")
    costs = np.array([data["costs"][m] for m in MODULES], dtype=float)  # [3, B]
    factor = np.array([float(data["bwd_factor"][m]) for m in MODULES])
    P = len(data["stage_map"])
    fwd, bwd = np.zeros((P, costs.shape[1])), np.zeros((P, costs.shape[1]))
    for s, entry in enumerate(data["stage_map"]):
        for part in entry.split("+"):
            module, _, share = part.partition("/")
            i = MODULES.index(module)
            fwd[s] += costs[i] / int(share or 1)
            bwd[s] += costs[i] * factor[i] / int(share or 1)
    D, M, S = int(data["D"]), int(data["M"]), int(data["S"])
    if costs.shape[1] != D * M * S:
        raise ValueError(f"{costs.shape[1]} sequences, expected D*M*S = {D * M * S}")
    return RefInstance(D, M, S, fwd, bwd, float(data.get("p2p_latency", 0.0)))


def plan_times(inst: RefInstance, plan: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """plan int[D, M, S] -> per-rank stage times F, B float[D, P, M] (microbatch = sum of its sequences)."""
    plan = np.asarray(plan)
    F = np.zeros((plan.shape[0], inst.P, plan.shape[1]))
    B = np.zeros_like(F)
    for k in range(plan.shape[2]):
        F += inst.seq_fwd[:, plan[:, :, k]].transpose(1, 0, 2)
        B += inst.seq_bwd[:, plan[:, :, k]].transpose(1, 0, 2)
    return F, B


@nb.njit(cache=True)
def _op(s, k, P, M):
    """The k-th op of stage s: (0 forward | 1 backward, microbatch)."""
    w = min(P - s - 1, M)
    if k < w:
        return 0, k
    if k < 2 * M - w:
        i = k - w
        return (0, w + i // 2) if i % 2 == 0 else (1, i // 2)
    return 1, k - M


@nb.njit(cache=True)
def simulate_rank(F, B, latency):
    """Makespan of one rank (F, B float[P, M]) by sweeping the stages: each stage runs its next ops
    while their inputs have ended (ends of -1: not yet run), until every op has run."""
    P, M = F.shape
    f_end, b_end = np.full((P, M), -1.0), np.full((P, M), -1.0)
    cursor, free = np.zeros(P, dtype=np.int64), np.zeros(P)
    done, span = 0, 0.0
    while done < 2 * P * M:
        before = done
        for s in range(P):
            while cursor[s] < 2 * M:
                kind, m = _op(s, cursor[s], P, M)
                if kind == 0:
                    ready = 0.0 if s == 0 else f_end[s - 1, m] + latency
                    if s > 0 and f_end[s - 1, m] < 0:
                        break
                    end = max(free[s], ready) + F[s, m]
                    f_end[s, m] = end
                else:
                    src = f_end[s, m] if s == P - 1 else b_end[s + 1, m]
                    if src < 0:
                        break
                    ready = src if s == P - 1 else src + latency
                    end = max(free[s], ready) + B[s, m]
                    b_end[s, m] = end
                free[s] = end
                span = max(span, end)
                cursor[s] += 1
                done += 1
        if done == before:
            raise ValueError("the 1F1B ops wait on each other: malformed schedule")
    return span


@nb.njit(cache=True)
def schedule(P, M):
    """int[2 P M, 4]: the ops (kind, stage, microbatch, dependency row or -1) in an order where every
    op comes after its stage's previous op and its input: the order the sweep of simulate_rank runs
    them in, which depends only on the dependencies, so any durations can be replayed in it."""
    n = 2 * P * M
    out = np.empty((n, 4), dtype=np.int64)
    row_of = np.full((2, P, M), -1, dtype=np.int64)
    cursor = np.zeros(P, dtype=np.int64)
    done = 0
    while done < n:
        for s in range(P):
            while cursor[s] < 2 * M:
                kind, m = _op(s, cursor[s], P, M)
                if kind == 0:
                    dep = row_of[0, s - 1, m] if s > 0 else -2
                else:
                    dep = row_of[0, s, m] if s == P - 1 else row_of[1, s + 1, m]
                if dep == -1:
                    break
                out[done, 0], out[done, 1], out[done, 2], out[done, 3] = kind, s, m, max(dep, -1)
                row_of[kind, s, m] = done
                cursor[s] += 1
                done += 1
    return out


@nb.njit(cache=True)
def replay(F, B, latency, sched, end, last):
    """simulate_rank by replaying ``sched`` (end float[2PM], last float[P] scratch)."""
    for s in range(last.shape[0]):
        last[s] = 0.0
    span = 0.0
    P = F.shape[0]
    for k in range(sched.shape[0]):
        kind, s, m, dep = sched[k, 0], sched[k, 1], sched[k, 2], sched[k, 3]
        t = last[s]
        if dep >= 0:
            ready = end[dep] + (latency if kind == 0 or s < P - 1 else 0.0)
            if ready > t:
                t = ready
        t += F[s, m] if kind == 0 else B[s, m]
        end[k] = t
        last[s] = t
        if t > span:
            span = t
    return span


@nb.njit(cache=True)
def replay_many(F, B, latency, sched):
    """Makespans of many ranks: F, B float[R, P, M] -> float[R]."""
    out = np.empty(F.shape[0])
    end, last = np.empty(sched.shape[0]), np.empty(F.shape[1])
    for r in range(F.shape[0]):
        out[r] = replay(F[r], B[r], latency, sched, end, last)
    return out


def check_plan(inst: RefInstance, plan: np.ndarray) -> np.ndarray:
    plan = np.asarray(plan, dtype=np.int64)
    if plan.shape != (inst.D, inst.M, inst.S) or not np.array_equal(np.sort(plan.ravel()),
                                                                     np.arange(inst.D * inst.M * inst.S)):
        raise ValueError(f"not a plan of every sequence once in shape {(inst.D, inst.M, inst.S)}")
    return plan


def rank_spans(inst: RefInstance, plan: np.ndarray) -> np.ndarray:
    """float[D]: every rank's makespan, by the sweep (simulate_rank)."""
    F, B = plan_times(inst, check_plan(inst, plan))
    return np.array([simulate_rank(F[r], B[r], inst.latency) for r in range(inst.D)])


def iteration_time(inst: RefInstance, plan: np.ndarray) -> float:
    """The slowest rank's makespan."""
    return float(rank_spans(inst, plan).max())


# ---- exact optima of small instances ----------------------------------------------------------


def _groupings(n: int, S: int) -> list[list[tuple[int, ...]]]:
    """Every split of items 0..n-1 into n / S unordered groups of S (the lowest free item opens a group)."""
    if n == 0:
        return [[]]
    out = []

    def rec(free: tuple[int, ...], acc: list[tuple[int, ...]]) -> None:
        if not free:
            out.append(list(acc))
            return
        head, rest = free[0], free[1:]
        for others in itertools.combinations(rest, S - 1):
            group = (head, *others)
            rec(tuple(x for x in rest if x not in others), acc + [group])

    rec(tuple(range(n)), [])
    return out


def rank_layouts(M: int, S: int) -> np.ndarray:
    """int[K, M, S]: every way to run M*S items as M microbatches of S in some order (positions of
    the items 0..M*S-1), each grouping in all M! orders."""
    layouts = [[groups[i] for i in order] for groups in _groupings(M * S, S)
               for order in itertools.permutations(range(M))]
    return np.array(layouts, dtype=np.int64).reshape(-1, M, S)


def best_rank(inst: RefInstance, items: np.ndarray, layouts: np.ndarray, sched: np.ndarray) -> tuple[float, np.ndarray]:
    """The fastest way one rank can run ``items`` (int[M*S] sequence ids): (makespan, int[M, S])."""
    seqs = items[layouts]  # [K, M, S]
    F = inst.seq_fwd[:, seqs].sum(axis=-1).transpose(1, 0, 2)  # [K, P, M]
    B = inst.seq_bwd[:, seqs].sum(axis=-1).transpose(1, 0, 2)
    spans = replay_many(np.ascontiguousarray(F), np.ascontiguousarray(B), inst.latency, sched)
    k = int(np.argmin(spans))
    return float(spans[k]), seqs[k]


def exact_optimum(inst: RefInstance) -> tuple[float, np.ndarray]:
    """The optimal iteration time and a plan reaching it, by exhaustive search with the ranks'
    symmetry: ranks are independent, so the optimum is the least, over splits of the batch into D
    unordered groups of M*S, of the slowest group's best makespan (best_rank: every grouping into
    microbatches, every order), and each group's best is computed once. Feasible for about B <= 12
    and M <= 4."""
    D, M, S = inst.D, inst.M, inst.S
    n = D * M * S
    layouts, sched = rank_layouts(M, S), schedule(inst.P, M)
    memo: dict[tuple[int, ...], tuple[float, np.ndarray]] = {}

    def best(group: tuple[int, ...]) -> tuple[float, np.ndarray]:
        if group not in memo:
            memo[group] = best_rank(inst, np.array(group, dtype=np.int64), layouts, sched)
        return memo[group]

    def split(free: tuple[int, ...], bound: float) -> tuple[float, list[np.ndarray]] | None:
        """The best split of ``free`` whose slowest group is below ``bound`` (branch and bound)."""
        if not free:
            return 0.0, []
        found: tuple[float, list[np.ndarray]] | None = None
        head, rest = free[0], free[1:]
        for others in itertools.combinations(rest, M * S - 1):
            span, layout = best((head, *others))
            if span >= bound:
                continue
            tail = split(tuple(x for x in rest if x not in others), bound)
            if tail is not None:
                total = max(span, tail[0])
                if total < bound:
                    bound, found = total, [layout, *tail[1]]
        return None if found is None else (bound, found)

    result = split(tuple(range(n)), math.inf)
    assert result is not None
    return result[0], np.stack(result[1])


def brute_force(inst: RefInstance) -> float:
    """The optimum by simulating every permutation of the batch as a plan (no symmetry used; B <= 8)."""
    n = inst.D * inst.M * inst.S
    sched = schedule(inst.P, inst.M)
    best = math.inf
    perms = np.array(list(itertools.permutations(range(n))), dtype=np.int64).reshape(-1, inst.D, inst.M, inst.S)
    for chunk in np.array_split(perms, max(1, len(perms) // 5000)):
        F = inst.seq_fwd[:, chunk].sum(axis=-1).transpose(1, 2, 0, 3)  # [K, D, P, M]
        B = inst.seq_bwd[:, chunk].sum(axis=-1).transpose(1, 2, 0, 3)
        K, D, P, M = F.shape
        spans = replay_many(np.ascontiguousarray(F.reshape(K * D, P, M)),
                            np.ascontiguousarray(B.reshape(K * D, P, M)), inst.latency, sched)
        best = min(best, float(spans.reshape(K, D).max(axis=1).min()))
    return best
