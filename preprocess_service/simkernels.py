"""Compiled (numba) kernels: the 1F1B simulation of one coupled component of ranks, and the
planner's local search that runs it for every candidate move.

simulate.py holds the readable reference simulator and the definitions; tests check that these
kernels agree with it exactly. Arrays are float64 seconds; ``order`` is the op order of
simulate._topological_order as three int arrays (kind 0 = forward / 1 = backward, stage,
microbatch), valid for coupled components too because coupling only joins ops of the same
(kind, stage, microbatch).
"""

from __future__ import annotations

import numba as nb
import numpy as np

ORDER_SWAP, ORDER_SHIFT, INSIDE, ACROSS = 0, 1, 2, 3


@nb.njit(cache=True, nogil=True)
def _simulate_rank(F, B, kinds, stages, mbs, latency, f_end, b_end, free):
    """simulate_component for one independent rank (F, B float[P, M]): the hot path, no groups."""
    P = F.shape[0]
    for s in range(P):
        free[s] = 0.0
    span = 0.0
    for k in range(kinds.shape[0]):
        s, m = stages[k], mbs[k]
        if kinds[k] == 0:
            t = f_end[s - 1, m] + latency if s > 0 else 0.0
            end = max(free[s], t) + F[s, m]
            f_end[s, m] = end
        else:
            t = f_end[s, m] if s == P - 1 else b_end[s + 1, m] + latency
            end = max(free[s], t) + B[s, m]
            b_end[s, m] = end
        free[s] = end
        if end > span:
            span = end
    return span


@nb.njit(cache=True, nogil=True)
def simulate_component(F, B, groups, kinds, stages, mbs, latency, f_end, b_end, free):
    """Makespan of one component: F, B float[L, P, M] stage times of its L ranks in execution order;
    groups int[P]: ranks that share one replica of each stage (1 = a stage per rank; a shared
    stage runs microbatch m of all its ranks as one op, after all their inputs are there, for the
    sum of their times). f_end, b_end float[L, P, M] and free float[L, P] are scratch."""
    L, P, M = F.shape
    if L == 1:
        return _simulate_rank(F[0], B[0], kinds, stages, mbs, latency, f_end[0], b_end[0], free[0])
    for r in range(L):
        for s in range(P):
            free[r, s] = 0.0
    for k in range(kinds.shape[0]):
        s, m, g = stages[k], mbs[k], groups[stages[k]]
        forward = kinds[k] == 0
        for j0 in range(0, L, g):
            ready, dur = 0.0, 0.0
            for r in range(j0, j0 + g):
                if forward:
                    t = f_end[r, s - 1, m] + latency if s > 0 else 0.0
                    dur += F[r, s, m]
                else:
                    t = f_end[r, s, m] if s == P - 1 else b_end[r, s + 1, m] + latency
                    dur += B[r, s, m]
                if t > ready:
                    ready = t
            end = max(free[j0, s], ready) + dur
            for r in range(j0, j0 + g):
                if forward:
                    f_end[r, s, m] = end
                else:
                    b_end[r, s, m] = end
                free[r, s] = end
    span = 0.0
    for r in range(L):
        for s in range(P):
            if free[r, s] > span:
                span = free[r, s]
    return span


@nb.njit(cache=True, nogil=True)
def component_spans(F, B, L, groups, kinds, stages, mbs, latency):
    """float[D / L]: makespan of every component of L consecutive ranks (F, B float[D, P, M])."""
    D, P, M = F.shape
    f_end, b_end, free = np.empty((L, P, M)), np.empty((L, P, M)), np.empty((L, P))
    out = np.empty(D // L)
    for c in range(D // L):
        out[c] = simulate_component(F[c * L:(c + 1) * L], B[c * L:(c + 1) * L], groups, kinds, stages, mbs,
                                    latency, f_end, b_end, free)
    return out


@nb.njit(cache=True, nogil=True)
def _add_sequence(T, r, m, times, new, old):
    for p in range(T.shape[1]):
        T[r, p, m] += times[p, new] - times[p, old]


@nb.njit(cache=True, nogil=True)
def _shift(a, i, j):
    """Moves a[i] to position j along axis 0 (a copy of the moved row is kept meanwhile)."""
    row = a[i].copy()
    if i < j:
        for k in range(i, j):
            a[k] = a[k + 1]
    else:
        for k in range(i, j, -1):
            a[k] = a[k - 1]
    a[j] = row


@nb.njit(cache=True, nogil=True)
def local_search(plan, sf, sb, F, B, L, groups, kinds, stages, mbs, latency, seed, max_evals, patience):
    """Improves ``plan`` int[D, M, S] in place; F, B float[D, P, M] are its per-rank stage times
    (kept up to date); sf, sb float[P, num_sequences] are per-sequence stage times.

    Every step takes the slowest component (ranks coupled by shared stages; one rank when nothing is
    shared) and one random member rank, draws one random move: swap two of its microbatches in the
    order, move one to another position, swap two of its sequences between microbatches, or swap one
    of its sequences with another rank's (half of the time a rank of the fastest component), and
    runs the exact simulation of every component the move touches. A move is kept when the slowest
    of them ends strictly earlier than the current iteration (first improvement). Stops after
    ``max_evals`` simulations or ``patience`` failed moves in a row (a local optimum, with high
    probability); deterministic for a given seed. Returns (moves kept, simulations run)."""
    D, M, S = plan.shape
    P = F.shape[1]
    C = D // L
    np.random.seed(seed)
    f_end, b_end, free = np.empty((L, P, M)), np.empty((L, P, M)), np.empty((L, P))
    spans = np.empty(C)
    for c in range(C):
        spans[c] = simulate_component(F[c * L:(c + 1) * L], B[c * L:(c + 1) * L], groups, kinds, stages, mbs,
                                      latency, f_end, b_end, free)
    cF, cB = np.empty((L, P, M)), np.empty((L, P, M))
    pF, pB = np.empty((L, P, M)), np.empty((L, P, M))
    kinds_allowed = np.empty(4, dtype=np.int64)
    n_kinds = 0
    if M > 1:
        kinds_allowed[n_kinds] = ORDER_SWAP
        kinds_allowed[n_kinds + 1] = ORDER_SHIFT
        n_kinds += 2
    if M > 1 and S > 1:
        kinds_allowed[n_kinds] = INSIDE
        n_kinds += 1
    if D > 1:
        kinds_allowed[n_kinds] = ACROSS
        n_kinds += 1
    evals, fails, kept = 0, 0, 0
    if n_kinds == 0:
        return kept, evals
    while evals < max_evals and fails < patience:
        c = int(np.argmax(spans))
        current = spans[c] * (1.0 - 1e-12)
        base = c * L
        lr = np.random.randint(L)
        r = base + lr
        cF[:] = F[base:base + L]
        cB[:] = B[base:base + L]
        kind = kinds_allowed[np.random.randint(n_kinds)]
        c2, w, i, j, a, b = -1, -1, 0, 0, 0, 0
        if kind == ORDER_SWAP or kind == ORDER_SHIFT or kind == INSIDE:
            i = np.random.randint(M)
            j = np.random.randint(M - 1)
            j += j >= i
            if kind == ORDER_SWAP:
                for p in range(P):
                    cF[lr, p, i], cF[lr, p, j] = cF[lr, p, j], cF[lr, p, i]
                    cB[lr, p, i], cB[lr, p, j] = cB[lr, p, j], cB[lr, p, i]
            elif kind == ORDER_SHIFT:
                Ft, Bt = cF[lr].T.copy(), cB[lr].T.copy()  # [M, P]
                _shift(Ft, i, j)
                _shift(Bt, i, j)
                cF[lr] = Ft.T
                cB[lr] = Bt.T
            else:
                a, b = np.random.randint(S), np.random.randint(S)
                x, y = plan[r, i, a], plan[r, j, b]
                _add_sequence(cF, lr, i, sf, y, x)
                _add_sequence(cF, lr, j, sf, x, y)
                _add_sequence(cB, lr, i, sb, y, x)
                _add_sequence(cB, lr, j, sb, x, y)
        else:
            if C > 1 and np.random.random() < 0.5:
                c2 = int(np.argmin(spans))
                w = c2 * L + np.random.randint(L)
            else:
                w = np.random.randint(D - 1)
                w += w >= r
                c2 = w // L
            if w == r:
                fails += 1
                continue
            i, a, j, b = np.random.randint(M), np.random.randint(S), np.random.randint(M), np.random.randint(S)
            x, y = plan[r, i, a], plan[w, j, b]
            _add_sequence(cF, lr, i, sf, y, x)
            _add_sequence(cB, lr, i, sb, y, x)
            if c2 == c:
                _add_sequence(cF, w - base, j, sf, x, y)
                _add_sequence(cB, w - base, j, sb, x, y)
            else:
                pF[:] = F[c2 * L:(c2 + 1) * L]
                pB[:] = B[c2 * L:(c2 + 1) * L]
                _add_sequence(pF, w - c2 * L, j, sf, x, y)
                _add_sequence(pB, w - c2 * L, j, sb, x, y)
        new = simulate_component(cF, cB, groups, kinds, stages, mbs, latency, f_end, b_end, free)
        evals += 1
        new2 = 0.0
        if c2 >= 0 and c2 != c:
            new2 = simulate_component(pF, pB, groups, kinds, stages, mbs, latency, f_end, b_end, free)
            evals += 1
        if max(new, new2) >= current:
            fails += 1
            continue
        fails = 0
        kept += 1
        F[base:base + L] = cF
        B[base:base + L] = cB
        spans[c] = new
        if kind == ORDER_SWAP:
            for k in range(S):
                plan[r, i, k], plan[r, j, k] = plan[r, j, k], plan[r, i, k]
        elif kind == ORDER_SHIFT:
            _shift(plan[r], i, j)
        elif kind == INSIDE:
            plan[r, i, a], plan[r, j, b] = plan[r, j, b], plan[r, i, a]
        else:
            plan[r, i, a], plan[w, j, b] = plan[w, j, b], plan[r, i, a]
            if c2 != c:
                F[c2 * L:(c2 + 1) * L] = pF
                B[c2 * L:(c2 + 1) * L] = pB
                spans[c2] = new2
    return kept, evals
