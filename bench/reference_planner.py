"""An independent reference for the whole-batch planner: its own 1F1B simulator, exact optima of
small instances, and a time-boxed search whose moves differ from ``ours``.

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
import time
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


# ---- an independent time-boxed search ---------------------------------------------------------


@nb.njit(cache=True)
def _vector_lpt(vec, items, key, bins, per_bin):
    """Vector LPT with equal counts: ``items`` by descending ``key``, each to the bin with room whose
    largest component (vec float[N, K], loads per component) stays lowest with it (ties: the lower
    sum, then the lower bin). Returns int[bins, per_bin] of items."""
    K = vec.shape[1]
    load = np.zeros((bins, K))
    count = np.zeros(bins, dtype=np.int64)
    out = np.empty((bins, per_bin), dtype=np.int64)
    for x in items[np.argsort(-key)]:
        best, best_max, best_sum = -1, np.inf, np.inf
        for b in range(bins):
            if count[b] == per_bin:
                continue
            hi, total = 0.0, 0.0
            for k in range(K):
                v = load[b, k] + vec[x, k]
                hi = max(hi, v)
                total += v
            if hi < best_max or (hi == best_max and total < best_sum):
                best, best_max, best_sum = b, hi, total
        out[best, count[best]] = x
        count[best] += 1
        for k in range(K):
            load[best, k] += vec[x, k]
    return out


def vector_lpt_plan(inst: RefInstance, rng: np.random.Generator | None = None, noise: float = 0.0) -> np.ndarray:
    """A starting plan: sequences to ranks by vector LPT on their per-stage work (forward + backward,
    each stage scaled by its mean load per rank, so every component counts alike), then each rank's
    sequences to its microbatches the same way; microbatches run in the order they were dealt.
    With ``noise`` > 0 the LPT keys are multiplied by lognormal noise of that sigma (restarts)."""
    D, M, S = inst.D, inst.M, inst.S
    work = (inst.seq_fwd + inst.seq_bwd).T  # [N, P]
    scale = work.sum(axis=0) / D
    vec = np.ascontiguousarray(work / np.where(scale > 0, scale, 1.0))
    key = vec.max(axis=1)
    if noise > 0 and rng is not None:
        key = key * rng.lognormal(0.0, noise, key.shape)
    ranks = _vector_lpt(vec, np.arange(D * M * S), key, D, M * S)
    return np.stack([_vector_lpt(vec * D / M, rank, key[rank], M, S) for rank in ranks])


@nb.njit(cache=True)
def _apply(F, B, r, m, sf, sb, new, old):
    for p in range(F.shape[1]):
        F[r, p, m] += sf[p, new] - sf[p, old]
        B[r, p, m] += sb[p, new] - sb[p, old]


def _kick(plan: np.ndarray, rng: np.random.Generator, fraction: float) -> np.ndarray:
    """A copy of ``plan`` with about ``fraction`` of its sequences swapped pairwise between random
    places of random ranks."""
    D, M, S = plan.shape
    flat = plan.reshape(-1).copy()
    for _ in range(max(1, int(fraction * flat.size / 2))):
        a, b = rng.integers(flat.size, size=2)
        flat[a], flat[b] = flat[b], flat[a]
    return flat.reshape(D, M, S)


@nb.njit(cache=True)
def _rank_pick(spans, power, top):
    """A rank drawn with weight (span / top) ** power: the slow ones, mostly."""
    total = 0.0
    for r in range(spans.shape[0]):
        total += (spans[r] / top) ** power
    u = np.random.random() * total
    for r in range(spans.shape[0]):
        u -= (spans[r] / top) ** power
        if u <= 0:
            return r
    return spans.shape[0] - 1


@nb.njit(cache=True)
def smooth_descent(plan, F, B, spans, sf, sb, sched, latency, max_evals, seed, power, best):
    """Random moves kept when they lower sum over ranks of (span / top) ** power (top: the slowest
    rank's span at the call): a smooth stand-in for the slowest rank that lets every rank make room.
    Ranks are drawn with that weight; a move is one of: swap two microbatches' places, move one to
    another place, swap two sequences between two of the rank's microbatches, swap one sequence with
    a uniformly drawn other rank's (any places), or swap one whole microbatch with another rank's.
    ``best`` int[D, M, S] receives the plan with the lowest slowest rank seen; returns its span."""
    np.random.seed(seed)
    D, M, S = plan.shape
    P = F.shape[1]
    end, last = np.empty(sched.shape[0]), np.empty(P)
    top = spans.max()
    best_span = top
    best[:] = plan
    colF, colB = np.empty(P), np.empty(P)
    row = np.empty(S, dtype=np.int64)
    for _ in range(max_evals):
        r = _rank_pick(spans, power, top)
        kind = np.random.randint(5)
        if (kind <= 2 and M == 1) or (kind == 2 and S == 1) or (kind >= 3 and D == 1):
            continue
        i = np.random.randint(M)
        j = np.random.randint(M - 1) if M > 1 else 0
        if kind <= 2 and j >= i:
            j += 1
        w = r
        if kind >= 3:
            w = np.random.randint(D - 1)
            w += w >= r
            j = np.random.randint(M)
        a, b = np.random.randint(S), np.random.randint(S)
        # apply
        if kind == 0:
            for p in range(P):
                F[r, p, i], F[r, p, j] = F[r, p, j], F[r, p, i]
                B[r, p, i], B[r, p, j] = B[r, p, j], B[r, p, i]
        elif kind == 1:
            step = 1 if i < j else -1
            for p in range(P):
                colF[p], colB[p] = F[r, p, i], B[r, p, i]
                k = i
                while k != j:
                    F[r, p, k], B[r, p, k] = F[r, p, k + step], B[r, p, k + step]
                    k += step
                F[r, p, j], B[r, p, j] = colF[p], colB[p]
        elif kind == 2 or kind == 3:
            x, y = plan[r, i, a], plan[w, j, b]
            _apply(F, B, r, i, sf, sb, y, x)
            _apply(F, B, w, j, sf, sb, x, y)
        else:
            for p in range(P):
                F[r, p, i], F[w, p, j] = F[w, p, j], F[r, p, i]
                B[r, p, i], B[w, p, j] = B[w, p, j], B[r, p, i]
        new_r = replay(F[r], B[r], latency, sched, end, last)
        new_w = replay(F[w], B[w], latency, sched, end, last) if w != r else new_r
        old = (spans[r] / top) ** power + ((spans[w] / top) ** power if w != r else 0.0)
        new = (new_r / top) ** power + ((new_w / top) ** power if w != r else 0.0)
        if new < old * (1.0 - 1e-12):
            spans[r], spans[w] = new_r, new_w
            if kind == 0:
                for k in range(S):
                    plan[r, i, k], plan[r, j, k] = plan[r, j, k], plan[r, i, k]
            elif kind == 1:
                row[:] = plan[r, i]
                step = 1 if i < j else -1
                k = i
                while k != j:
                    plan[r, k] = plan[r, k + step]
                    k += step
                plan[r, j] = row
            elif kind == 2 or kind == 3:
                plan[r, i, a], plan[w, j, b] = plan[w, j, b], plan[r, i, a]
            else:
                row[:] = plan[r, i]
                plan[r, i] = plan[w, j]
                plan[w, j] = row
            slowest = spans.max()
            if slowest < best_span:
                best_span = slowest
                best[:] = plan
            continue
        # undo
        if kind == 0:
            for p in range(P):
                F[r, p, i], F[r, p, j] = F[r, p, j], F[r, p, i]
                B[r, p, i], B[r, p, j] = B[r, p, j], B[r, p, i]
        elif kind == 1:
            step = 1 if j < i else -1
            for p in range(P):
                colF[p], colB[p] = F[r, p, j], B[r, p, j]
                k = j
                while k != i:
                    F[r, p, k], B[r, p, k] = F[r, p, k + step], B[r, p, k + step]
                    k += step
                F[r, p, i], B[r, p, i] = colF[p], colB[p]
        elif kind == 2 or kind == 3:
            x, y = plan[r, i, a], plan[w, j, b]
            _apply(F, B, r, i, sf, sb, x, y)
            _apply(F, B, w, j, sf, sb, y, x)
        else:
            for p in range(P):
                F[r, p, i], F[w, p, j] = F[w, p, j], F[r, p, i]
                B[r, p, i], B[w, p, j] = B[w, p, j], B[r, p, i]
    return best_span


SMOOTH_POWER = 30.0
"""The exponent of the search's smooth objective (smooth_descent)."""
CHUNK_EVALS = 50_000
STALE_CHUNKS = 4
"""A restart follows this many chunks of CHUNK_EVALS simulations without a faster plan."""


def search(inst: RefInstance, seconds: float, seed: int = 0) -> tuple[float, np.ndarray]:
    """Independent time-boxed search: from the vector-LPT plan, smooth_descent in chunks until
    ``seconds`` of wall time are up; after STALE_CHUNKS chunks without a faster plan, a restart,
    alternately from a fresh vector-LPT plan with noisy keys and from the best plan with 1% of its
    sequences swapped at random. Returns (iteration time, plan) of the fastest plan seen."""
    rng = np.random.default_rng([seed, 0x12EF])
    sched = schedule(inst.P, inst.M)
    sf, sb = np.ascontiguousarray(inst.seq_fwd), np.ascontiguousarray(inst.seq_bwd)
    deadline = time.perf_counter() + seconds
    plan = check_plan(inst, vector_lpt_plan(inst)).copy()
    best, best_s, restart = plan.copy(), math.inf, 0
    while True:
        F, B = plan_times(inst, plan)
        spans = replay_many(F, B, inst.latency, sched)
        found, stale = plan.copy(), 0
        while stale < STALE_CHUNKS and time.perf_counter() < deadline:
            span = smooth_descent(plan, F, B, spans, sf, sb, sched, inst.latency, CHUNK_EVALS,
                                  int(rng.integers(2**31 - 1)), SMOOTH_POWER, found)
            stale += 1
            if span < best_s:
                best, best_s, stale = found.copy(), span, 0
        if time.perf_counter() >= deadline:
            return best_s, best
        restart += 1
        plan = vector_lpt_plan(inst, rng, 0.3) if restart % 2 else _kick(best, rng, 0.01)
