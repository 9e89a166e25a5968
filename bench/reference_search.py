"""The planner's independent reference search: a vector-LPT start, random restarts, and swaps across
ranks and slots under a smooth objective, on reference_planner's simulator (no code shared with the
planner; independent ranks only, as reference_planner)."""

from __future__ import annotations

import math
import time

import numba as nb
import numpy as np
from reference_planner import RefInstance, check_plan, plan_times, replay, replay_many, schedule


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


@nb.njit(cache=True)
def _move_times(F, B, kind, r, w, i, j, x, y, sf, sb, colF, colB):
    """Applies one move of smooth_descent to the stage times F, B [D, P, M] (the plan is changed by
    the caller only if the move is kept): 0 swaps rank r's microbatches i and j, 1 moves its i-th to
    place j, 2 and 3 put sequence y where x was (rank r, microbatch i) and x where y was (rank w,
    microbatch j), 4 swaps rank r's microbatch i with rank w's j."""
    P = F.shape[1]
    if kind == 0 or kind == 4:
        for p in range(P):
            F[r, p, i], F[w, p, j] = F[w, p, j], F[r, p, i]
            B[r, p, i], B[w, p, j] = B[w, p, j], B[r, p, i]
    elif kind == 1:
        step = 1 if i < j else -1
        for p in range(P):
            colF[p], colB[p] = F[r, p, i], B[r, p, i]
            k = i
            while k != j:
                F[r, p, k], B[r, p, k] = F[r, p, k + step], B[r, p, k + step]
                k += step
            F[r, p, j], B[r, p, j] = colF[p], colB[p]
    else:
        _apply(F, B, r, i, sf, sb, y, x)
        _apply(F, B, w, j, sf, sb, x, y)


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
def _max(values):
    top = values[0]
    for v in values[1:]:
        if v > top:
            top = v
    return top


@nb.njit(cache=True)
def _copy_plan(src, dst):
    D, M, S = src.shape
    for r in range(D):
        for m in range(M):
            for k in range(S):
                dst[r, m, k] = src[r, m, k]


@nb.njit(cache=True)
def smooth_descent(plan, F, B, spans, sf, sb, sched, latency, max_evals, seed, power, best):
    """Random moves kept when they lower sum over ranks of (span / top) ** power (top: the slowest
    rank's span at the call): a smooth stand-in for the slowest rank that lets every rank make room.
    Ranks are drawn with that weight; a move is one of: swap two microbatches' places, move one to
    another place, swap two sequences between two of the rank's microbatches, swap one sequence with
    a uniformly drawn other rank's (any places), or swap one whole microbatch with another rank's.
    ``best`` int[D, M, S] receives the plan with the lowest slowest rank seen; returns its span."""
    # Copies and maxima are written as loops: numba's slice assignment compiles a shape check with a
    # formatted error message, which doubled this kernel's compile time (seconds on a cold cache).
    np.random.seed(seed)
    D, M, S = plan.shape
    P = F.shape[1]
    end, last = np.empty(sched.shape[0]), np.empty(P)
    top = _max(spans)
    best_span = top
    _copy_plan(plan, best)
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
        _move_times(F, B, kind, r, w, i, j, plan[r, i, a], plan[w, j, b], sf, sb, colF, colB)
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
                for k in range(S):
                    row[k] = plan[r, i, k]
                step = 1 if i < j else -1
                k = i
                while k != j:
                    for q in range(S):
                        plan[r, k, q] = plan[r, k + step, q]
                    k += step
                for k in range(S):
                    plan[r, j, k] = row[k]
            elif kind == 2 or kind == 3:
                plan[r, i, a], plan[w, j, b] = plan[w, j, b], plan[r, i, a]
            else:
                for k in range(S):
                    row[k] = plan[r, i, k]
                    plan[r, i, k] = plan[w, j, k]
                    plan[w, j, k] = row[k]
            slowest = _max(spans)
            if slowest < best_span:
                best_span = slowest
                _copy_plan(plan, best)
            continue
        # undo: a swap is its own inverse, a move goes back from j to i, an exchange of x for y back
        _move_times(F, B, kind, r, w, j if kind == 1 else i, i if kind == 1 else j, plan[w, j, b],
                    plan[r, i, a], sf, sb, colF, colB)
    return best_span


SMOOTH_POWER = 30.0
"""The exponent of the search's smooth objective (smooth_descent)."""
CHUNK_EVALS = 50_000
STALE_CHUNKS = 4
"""A restart follows this many chunks of CHUNK_EVALS simulations without a faster plan."""


def search(inst: RefInstance, seconds: float, seed: int = 0) -> tuple[float, np.ndarray]:
    """Independent time-boxed search: from the vector-LPT plan, smooth_descent in chunks until it has
    run ``seconds`` of CPU time (this thread's: the same search on a busy machine); after STALE_CHUNKS
    chunks without a faster plan, a restart, alternately from a fresh vector-LPT plan with noisy keys
    and from the best plan with 1% of its sequences swapped at random. Returns (iteration time,
    plan) of the fastest plan seen."""
    rng = np.random.default_rng([seed, 0x12EF])
    sched = schedule(inst.P, inst.M)
    sf, sb = np.ascontiguousarray(inst.seq_fwd), np.ascontiguousarray(inst.seq_bwd)
    deadline = time.thread_time() + seconds
    plan = check_plan(inst, vector_lpt_plan(inst)).copy()
    best, best_s, restart = plan.copy(), math.inf, 0
    while True:
        F, B = plan_times(inst, plan)
        spans = replay_many(F, B, inst.latency, sched)
        found, stale = plan.copy(), 0
        while stale < STALE_CHUNKS and time.thread_time() < deadline:
            span = smooth_descent(plan, F, B, spans, sf, sb, sched, inst.latency, CHUNK_EVALS,
                                  int(rng.integers(2**31 - 1)), SMOOTH_POWER, found)
            stale += 1
            if span < best_s:
                best, best_s, stale = found.copy(), span, 0
        if time.thread_time() >= deadline:
            return best_s, best
        restart += 1
        plan = vector_lpt_plan(inst, rng, 0.3) if restart % 2 else _kick(best, rng, 0.01)


def warm_up() -> None:
    """Compiles the search's kernels (or loads them from numba's on-disk cache) on a tiny instance,
    with the argument types search() passes: a search is boxed by CPU time, and on a cold cache
    compiling takes seconds of it (a 0.5 s --quick search returned no plan at all)."""
    inst = RefInstance(D=2, M=2, S=1, seq_fwd=np.ones((2, 4)), seq_bwd=np.ones((2, 4)), latency=0.0)
    sched = schedule(inst.P, inst.M)
    sf, sb = np.ascontiguousarray(inst.seq_fwd), np.ascontiguousarray(inst.seq_bwd)
    plan = check_plan(inst, vector_lpt_plan(inst, np.random.default_rng(0), 0.3)).copy()
    F, B = plan_times(inst, plan)
    spans = replay_many(F, B, inst.latency, sched)
    smooth_descent(plan, F, B, spans, sf, sb, sched, inst.latency, 1, 0, SMOOTH_POWER, plan.copy())
