"""Compiled (numba) kernels: the 1F1B simulation of one coupled component of ranks, and the
planner's local search that runs it for every candidate move.

simulate.py holds the readable reference simulator and the definitions; tests check that these
kernels agree with it exactly. Arrays are float64 seconds; ``order`` is the op order of
simulate.topological_order as three int arrays (kind 0 = forward / 1 = backward, stage,
microbatch), valid for coupled components too because coupling only joins ops of the same
(kind, stage, microbatch).
"""

from __future__ import annotations

import numba as nb
import numpy as np

ORDER_SWAP, ORDER_SHIFT, INSIDE, ACROSS = 0, 1, 2, 3
PAIR_DRAWS = 8
"""Random sequence pairs a swap between ranks picks from (local_search)."""


@nb.njit(cache=True, nogil=True)
def _simulate_rank(F, B, groups, kinds, stages, mbs, latency, f_end, b_end, free):
    """simulate_component for one independent rank (F, B float[P, M]): the hot path, no sharing."""
    P = F.shape[0]
    for s in range(P):
        for j in range(free.shape[1]):
            free[s, j] = 0.0
    span = 0.0
    for k in range(kinds.shape[0]):
        s, m = stages[k], mbs[k]
        j = m % -groups[s] if groups[s] < 0 else 0
        if kinds[k] == 0:
            t = f_end[s - 1, m] + latency if s > 0 else 0.0
            end = max(free[s, j], t) + F[s, m]
            f_end[s, m] = end
        else:
            t = f_end[s, m] if s == P - 1 else b_end[s + 1, m] + latency
            end = max(free[s, j], t) + B[s, m]
            b_end[s, m] = end
        free[s, j] = end
        if end > span:
            span = end
    return span


@nb.njit(cache=True, nogil=True)
def simulate_component(F, B, groups, kinds, stages, mbs, latency, f_end, b_end, free):
    """Makespan of one component: F, B float[L, P, M] stage times of its L ranks in execution order;
    groups int[P]: how ranks share the replicas of each stage (StageModel.kernel_groups): g >= 1,
    one replica per g ranks (a shared stage runs microbatch m of all its ranks as one op, after all
    their inputs are there, for the sum of their times); -k, k replicas per rank, microbatch m on
    replica m % k. f_end, b_end float[L, P, M] and free float[L, P, K] (K >= every k) are scratch."""
    L, P, M = F.shape
    if L == 1:
        return _simulate_rank(F[0], B[0], groups, kinds, stages, mbs, latency, f_end[0], b_end[0], free[0])
    for r in range(L):
        for s in range(P):
            for j in range(free.shape[2]):
                free[r, s, j] = 0.0
    span = 0.0
    for k in range(kinds.shape[0]):
        s, m = stages[k], mbs[k]
        g = groups[s] if groups[s] > 0 else 1
        j = m % -groups[s] if groups[s] < 0 else 0
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
            end = max(free[j0, s, j], ready) + dur
            for r in range(j0, j0 + g):
                if forward:
                    f_end[r, s, m] = end
                else:
                    b_end[r, s, m] = end
                free[r, s, j] = end
            if end > span:
                span = end
    return span


@nb.njit(cache=True, nogil=True)
def flat_schedule(groups, kinds, stages, mbs, P, M, latency):
    """The op order of one independent rank (no shared stage: every groups[s] is 1 or -k) as flat
    arrays for simulate_flat: for op k, the flat index s * M + m of its duration, the op whose
    output it waits for (-1: none) and that wait's latency, and the previous op of the same
    replica (-1: none)."""
    n = kinds.shape[0]
    pos = np.empty((2, P, M), dtype=np.int64)
    for k in range(n):
        pos[kinds[k], stages[k], mbs[k]] = k
    src, dep, prev = np.empty(n, dtype=np.int64), np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64)
    lat = np.zeros(n)
    last = np.full((P, max(1, -groups.min())), -1, dtype=np.int64)
    for k in range(n):
        s, m = stages[k], mbs[k]
        src[k] = s * M + m
        if kinds[k] == 0:
            if s > 0:
                dep[k], lat[k] = pos[0, s - 1, m], latency
        elif s == P - 1:
            dep[k] = pos[0, s, m]
        else:
            dep[k], lat[k] = pos[1, s + 1, m], latency
        j = m % -groups[s] if groups[s] < 0 else 0
        prev[k] = last[s, j]
        last[s, j] = k
    return src, dep, lat, prev


@nb.njit(cache=True, nogil=True)
def simulate_flat(F, B, base, kinds, src, dep, lat, prev, end):
    """Makespan of one independent rank whose stage times are F, B flat (float[D * P * M], the rank's
    from ``base``), by the flat_schedule arrays; end float[num_ops] is scratch. Equal to
    simulate_component for that rank, about twice as fast: two array lookups per op."""
    span = 0.0
    for k in range(kinds.shape[0]):
        t = end[dep[k]] + lat[k] if dep[k] >= 0 else 0.0
        p = prev[k]
        if p >= 0 and end[p] > t:
            t = end[p]
        t += F[base + src[k]] if kinds[k] == 0 else B[base + src[k]]
        end[k] = t
        if t > span:
            span = t
    return span


@nb.njit(cache=True, nogil=True)
def component_spans(F, B, L, groups, kinds, stages, mbs, latency):
    """float[D / L]: makespan of every component of L consecutive ranks (F, B float[D, P, M])."""
    D, P, M = F.shape
    f_end, b_end, free = np.empty((L, P, M)), np.empty((L, P, M)), np.empty((L, P, max(1, -groups.min())))
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
def _swap_cols(F, B, r, i, j):
    for p in range(F.shape[1]):
        F[r, p, i], F[r, p, j] = F[r, p, j], F[r, p, i]
        B[r, p, i], B[r, p, j] = B[r, p, j], B[r, p, i]


@nb.njit(cache=True, nogil=True)
def _shift_cols(F, B, r, i, j, colF, colB):
    """Moves microbatch column i of rank r to position j (the ones between move up by one)."""
    P = F.shape[1]
    for p in range(P):
        colF[p], colB[p] = F[r, p, i], B[r, p, i]
    step = 1 if i < j else -1
    for k in range(i, j, step):
        for p in range(P):
            F[r, p, k], B[r, p, k] = F[r, p, k + step], B[r, p, k + step]
    for p in range(P):
        F[r, p, j], B[r, p, j] = colF[p], colB[p]


@nb.njit(cache=True, nogil=True)
def _save(F, B, r, i, j, saved, slot):
    """Saves columns i and j of rank r (F and B) into saved[slot], saved[slot + 1]."""
    for p in range(F.shape[1]):
        saved[slot, 0, p], saved[slot, 1, p] = F[r, p, i], B[r, p, i]
        saved[slot + 1, 0, p], saved[slot + 1, 1, p] = F[r, p, j], B[r, p, j]


@nb.njit(cache=True, nogil=True)
def _restore(F, B, r, i, j, saved, slot):
    for p in range(F.shape[1]):
        F[r, p, j], B[r, p, j] = saved[slot + 1, 0, p], saved[slot + 1, 1, p]
        F[r, p, i], B[r, p, i] = saved[slot, 0, p], saved[slot, 1, p]


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
    of its sequences with another rank's (three times in four a rank of the fastest component), and
    runs the exact simulation of every component the move touches. A move is kept when the slowest
    of them ends strictly earlier than the current iteration (first improvement). Stops after
    ``max_evals`` simulations or ``patience`` failed moves in a row (a local optimum, with high
    probability); deterministic for a given seed. Returns (moves kept, simulations run)."""
    D, M, S = plan.shape
    P = F.shape[1]
    C = D // L
    np.random.seed(seed)
    f_end, b_end, free = np.empty((L, P, M)), np.empty((L, P, M)), np.empty((L, P, max(1, -groups.min())))
    spans = np.empty(C)
    flat = L == 1  # independent ranks: the flat kernel
    src, dep, lat, prev = flat_schedule(groups, kinds, stages, mbs, P, M, latency)
    Ff, Bf, end = F.reshape(-1), B.reshape(-1), np.empty(kinds.shape[0])
    for c in range(C):
        spans[c] = simulate_component(F[c * L:(c + 1) * L], B[c * L:(c + 1) * L], groups, kinds, stages, mbs,
                                      latency, f_end, b_end, free)
    colF, colB, saved = np.empty(P), np.empty(P), np.empty((4, 2, P))
    total = np.zeros(sf.shape[1])
    for p in range(P):
        for q in range(sf.shape[1]):
            total[q] += sf[p, q] + sb[p, q]
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
    tries, wins, rates = np.zeros(4), np.zeros(4), np.ones(4)
    evals, fails, kept = 0, 0, 0
    if n_kinds == 0:
        return kept, evals
    # the slowest and fastest components change only when a move is kept: found again only then
    slowest, fastest = int(np.argmax(spans)), int(np.argmin(spans))
    while evals < max_evals and fails < patience:
        c = slowest
        current = spans[c] * (1.0 - 1e-12)
        base = c * L
        r = base + np.random.randint(L)
        # move kinds in proportion to how often they have paid off (with a floor), so that the
        # budget goes to balancing across ranks once a rank's own order is as good as it gets
        u = np.random.random() * (rates[:n_kinds].sum())
        pick = 0
        while pick < n_kinds - 1 and u >= rates[pick]:
            u -= rates[pick]
            pick += 1
        kind = kinds_allowed[pick]
        c2, w, i, j, a, b = c, r, 0, 0, 0, 0
        # Moves are applied to F, B in place (the touched columns saved first) and undone exactly
        # when they do not pay off: no copy of whole components per candidate.
        if kind == ORDER_SWAP or kind == ORDER_SHIFT or kind == INSIDE:
            i = np.random.randint(M)
            j = np.random.randint(M - 1)
            j += j >= i
            if kind == ORDER_SWAP:
                _swap_cols(F, B, r, i, j)
            elif kind == ORDER_SHIFT:
                _shift_cols(F, B, r, i, j, colF, colB)
            else:
                a, b = np.random.randint(S), np.random.randint(S)
                x, y = plan[r, i, a], plan[r, j, b]
                _save(F, B, r, i, j, saved, 0)
                _add_sequence(F, r, i, sf, y, x)
                _add_sequence(F, r, j, sf, x, y)
                _add_sequence(B, r, i, sb, y, x)
                _add_sequence(B, r, j, sb, x, y)
        else:
            if C > 1 and np.random.random() < 0.75:
                c2 = fastest
                w = c2 * L + np.random.randint(L)
            else:
                w = np.random.randint(D - 1)
                w += w >= r
                c2 = w // L
            if w == r:
                fails += 1
                continue
            # of PAIR_DRAWS random pairs (one of r's sequences, one of w's), the one whose difference
            # in total work is closest to half the two components' gap, r's the heavier: random
            # swaps would mostly make the slowest rank heavier, or move too much or too little
            target = 0.5 * (spans[c] - spans[c2]) if c2 != c else 0.0
            i, a, j, b, miss = 0, 0, 0, 0, np.inf
            for _ in range(PAIR_DRAWS):
                i2, a2, j2, b2 = np.random.randint(M), np.random.randint(S), np.random.randint(M), np.random.randint(S)
                diff = total[plan[r, i2, a2]] - total[plan[w, j2, b2]]
                off = abs(diff - target) if diff > 0 else np.inf
                if off < miss or (miss == np.inf and _ == 0):
                    i, a, j, b, miss = i2, a2, j2, b2, off
            x, y = plan[r, i, a], plan[w, j, b]
            _save(F, B, r, i, i, saved, 0)
            _save(F, B, w, j, j, saved, 2)
            _add_sequence(F, r, i, sf, y, x)
            _add_sequence(B, r, i, sb, y, x)
            _add_sequence(F, w, j, sf, x, y)
            _add_sequence(B, w, j, sb, x, y)
        if flat:
            new = simulate_flat(Ff, Bf, r * P * M, kinds, src, dep, lat, prev, end)
        else:
            new = simulate_component(F[base:base + L], B[base:base + L], groups, kinds, stages, mbs, latency,
                                     f_end, b_end, free)
        evals += 1
        new2 = 0.0
        if c2 != c and new < current:  # else rejected whatever the other component's span
            if flat:
                new2 = simulate_flat(Ff, Bf, w * P * M, kinds, src, dep, lat, prev, end)
            else:
                new2 = simulate_component(F[c2 * L:(c2 + 1) * L], B[c2 * L:(c2 + 1) * L], groups, kinds, stages,
                                          mbs, latency, f_end, b_end, free)
            evals += 1
        better = max(new, new2) < current
        tries[pick] += 1
        wins[pick] += better
        rates[pick] = max(0.05, (wins[pick] + 1.0) / (tries[pick] + 2.0))
        if not better:  # undo
            if kind == ORDER_SWAP:
                _swap_cols(F, B, r, i, j)
            elif kind == ORDER_SHIFT:
                _shift_cols(F, B, r, j, i, colF, colB)
            elif kind == INSIDE:
                _restore(F, B, r, i, j, saved, 0)
            else:
                _restore(F, B, w, j, j, saved, 2)
                _restore(F, B, r, i, i, saved, 0)
            fails += 1
            continue
        fails = 0
        kept += 1
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
                spans[c2] = new2
        slowest, fastest = int(np.argmax(spans)), int(np.argmin(spans))
    return kept, evals
