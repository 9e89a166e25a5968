"""Our whole-batch planner: balancing the loads a 1F1B pipeline really waits on, as a vector;
microbatch formation; and a local search with the exact simulator in the loop, within a time budget.

What a rank's makespan is made of (bounds.py): for every stage, its work plus the fill before and
the drain after it; and for every stage s together with the last stage, both their works minus
what 1F1B lets overlap (a heavy generator microbatch stalls the backbone stages, because only
P - s microbatches can be in flight at stage s). Each of these is a sum over the rank's sequences,
so a sequence is a vector of loads, one per term, and the makespan is close to the largest term.

1. Ranks: sequences are dealt in rounds of D, heaviest first: each round's heaviest sequence goes to
   the rank whose largest term is lowest, and so on, so every rank gets M*S sequences and the terms
   are balanced as a vector, not as their sum.
2. Microbatches: each rank's sequences are dealt the same way into M microbatches of S (by stage
   times), so the stage times of its microbatches come out even.
3. Order: cheapest fill first, cheapest drain last, the rest by the paper's organ pipe.
   Steps 1-3 are one starting plan; the scalar ``lpt`` + ``paper`` plan is the other; the search
   starts from whichever the simulator says is faster, so ours is never worse than ``lpt``.
4. Local search, always on the currently slowest rank: swap two of its microbatches in the order,
   swap two of its sequences between microbatches, or swap one of its sequences with another rank's.
   Every candidate is screened with the vectorised makespan bound (bounds.pipeline_lower_bounds,
   tight in practice and cheap for thousands of candidates); the most promising are run through the
   exact simulator, and the best real improvement is kept, until none is left or the budget is spent.
   Ranks meet only at the gradient all-reduce, so the objective is the slowest rank's makespan.
"""

from __future__ import annotations

import time

import numpy as np

from preprocess_service import reorder
from preprocess_service.bounds import pipeline_lower_bounds
from preprocess_service.simulate import makespans

EXACT_PER_ROUND = 16
"""Candidates per round that pass the screen and run through the exact simulator."""


def _load_terms(seq_fwd: np.ndarray, seq_bwd: np.ndarray, S: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-sequence loads float[B, K] and per-rank offsets float[K] of the makespan's terms (module
    docstring): stage work, and stage s coupled with the last stage, with the overlap window of a
    typical microbatch. Duplicate terms (identical backbone stages) are dropped."""
    P = seq_fwd.shape[0]
    work = seq_fwd + seq_bwd
    fill = np.cumsum(seq_fwd, axis=0) - seq_fwd
    drain = np.cumsum(seq_bwd, axis=0) - seq_bwd
    around = S * (np.median(fill, axis=1) + np.median(drain, axis=1))
    terms, offsets = list(work), list(around)
    last = work[-1]
    for s in range(P - 1):
        cap = (P - s - 1) * S * work[s].mean()
        terms.append(work[s] + last - np.minimum(last, cap))
        offsets.append(around[s])
    loads = np.stack(terms, axis=1)
    _, keep = np.unique(np.round(np.vstack([loads, offsets]), 12), axis=1, return_index=True)
    keep = np.sort(keep)
    return loads[:, keep], np.asarray(offsets)[keep]


def _deal_rounds(loads: np.ndarray, offsets: np.ndarray, items: np.ndarray, bins: int) -> np.ndarray:
    """items int[G, bins * per_bin] (G independent groups) -> int[G, bins, per_bin].

    Round j takes each group's next ``bins`` heaviest items (by their largest term) and gives the
    heaviest to the bin whose largest term is lowest so far, the next to the next, and so on: every
    bin gets one item per round, so counts stay equal, and vectorised over groups and bins."""
    G, n = items.shape
    per_bin = n // bins
    key = loads[items].max(axis=2)  # [G, n]
    ordered = np.take_along_axis(items, np.argsort(-key, axis=1, kind="stable"), axis=1)
    acc = np.broadcast_to(offsets, (G, bins, len(offsets))).copy()
    out = np.empty((G, bins, per_bin), dtype=np.int64)
    rows = np.arange(G)[:, None]
    for j in range(per_bin):
        chunk = ordered[:, j * bins:(j + 1) * bins]  # heaviest first
        lightest = np.argsort(acc.max(axis=2), axis=1, kind="stable")  # [G, bins]
        out[rows, lightest, j] = chunk
        acc[rows, lightest] += loads[chunk]
    return out


def _initial_order(fwd: np.ndarray, bwd: np.ndarray) -> np.ndarray:
    """fwd, bwd float[P, M] of one rank -> a permutation of its M microbatches."""
    M = fwd.shape[1]
    total = (fwd + bwd).sum(axis=0)
    order = list(reorder.inter_paper(total[None, :], None)[0])
    if M > 2:
        fill = fwd[:-1].sum(axis=0) if fwd.shape[0] > 1 else fwd.sum(axis=0)
        drain = bwd[:-1].sum(axis=0) if bwd.shape[0] > 1 else bwd.sum(axis=0)
        first = int(np.argmin(fill))
        rest = [m for m in order if m != first]
        last = min(rest, key=lambda m: drain[m])
        middle = [m for m in rest if m != last]
        order = [first, *middle, last]
    return np.array(order)


def _vector_start(seq_fwd: np.ndarray, seq_bwd: np.ndarray, D: int, M: int, S: int) -> np.ndarray:
    loads, offsets = _load_terms(seq_fwd, seq_bwd, S)
    ranks = _deal_rounds(loads, offsets, np.arange(D * M * S)[None], D)[0]  # [D, M*S]
    stage_work = (seq_fwd + seq_bwd).T
    plan = _deal_rounds(stage_work, np.zeros(stage_work.shape[1]), ranks, M)  # [D, M, S]
    for rank in range(D):
        fwd, bwd = seq_fwd[:, plan[rank]].sum(axis=-1), seq_bwd[:, plan[rank]].sum(axis=-1)
        plan[rank] = plan[rank][_initial_order(fwd, bwd)]
    return plan


def _scalar_start(instance) -> np.ndarray:
    return reorder.plan_batch(instance.totals, D=instance.D, M=instance.M, S=instance.S, intra="lpt",
                              inter="paper", rng=None)


class _Search:
    """A plan under search: plan int[D, M, S] plus every rank's exact makespan."""

    def __init__(self, plan: np.ndarray, seq_fwd: np.ndarray, seq_bwd: np.ndarray, latency: float,
                 rng: np.random.Generator, sample: int):
        self.plan, self.seq_fwd, self.seq_bwd, self.latency = plan, seq_fwd, seq_bwd, latency
        self.rng, self.sample = rng, sample
        self.makespan = makespans(*self.times(plan), latency)

    def times(self, plans: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """plans int[R, M, S] -> stage times float[R, P, M] (fwd, bwd)."""
        fwd = self.seq_fwd[:, plans].sum(axis=-1).transpose(1, 0, 2)
        bwd = self.seq_bwd[:, plans].sum(axis=-1).transpose(1, 0, 2)
        return fwd, bwd

    def _pairs(self, n: int, m: int, *, distinct: bool) -> np.ndarray:
        """Up to ``sample`` index pairs (a < n, b < m), all of them when there are few enough."""
        total = n * m
        if total <= self.sample:
            a, b = np.divmod(np.arange(total), m)
        else:
            a, b = self.rng.integers(0, n, self.sample), self.rng.integers(0, m, self.sample)
        keep = a < b if distinct else np.ones(a.shape, dtype=bool)
        return np.column_stack([a[keep], b[keep]])

    def _own_moves(self, slow: int) -> np.ndarray:
        """Plans of ``slow`` with two microbatches swapped in the order, or two of its sequences
        swapped between microbatches: int[K, M, S]."""
        M, S = self.plan.shape[1:]
        mine = self.plan[slow]
        pairs = self._pairs(M, M, distinct=True)
        order = np.repeat(mine[None], len(pairs), axis=0)
        rows = np.arange(len(pairs))
        order[rows, pairs[:, 0]], order[rows, pairs[:, 1]] = mine[pairs[:, 1]], mine[pairs[:, 0]]
        if S == 1:
            return order
        pos = self._pairs(M * S, M * S, distinct=True)
        pos = pos[pos[:, 0] // S != pos[:, 1] // S]
        flat = np.repeat(mine.reshape(1, -1), len(pos), axis=0)
        rows = np.arange(len(pos))
        flat[rows, pos[:, 0]], flat[rows, pos[:, 1]] = mine.ravel()[pos[:, 1]], mine.ravel()[pos[:, 0]]
        return np.concatenate([order, flat.reshape(-1, M, S)])

    def _swap_moves(self, slow: int, partners: np.ndarray):
        """(slow plans, partner plans, partner ids) with one sequence exchanged between ``slow`` and
        a partner rank."""
        M, S = self.plan.shape[1:]
        n = M * S
        pairs = self._pairs(n, n * len(partners), distinct=False)
        who = partners[pairs[:, 1] // n]
        a, b = pairs[:, 0], pairs[:, 1] % n
        flat = self.plan.reshape(len(self.plan), n)
        slow_c = np.repeat(flat[slow][None], len(pairs), axis=0)
        other_c = flat[who].copy()
        rows = np.arange(len(pairs))
        slow_c[rows, a], other_c[rows, b] = flat[who, b], flat[slow, a]
        return slow_c.reshape(-1, M, S), other_c.reshape(-1, M, S), who

    def improve(self) -> bool:
        """One round on the slowest rank; False when no candidate improves it (a local optimum)."""
        D = len(self.plan)
        slow = int(np.argmax(self.makespan))
        current = self.makespan[slow]
        own = self._own_moves(slow)
        candidates = [(own, None, None)]
        if D > 1:
            others = np.flatnonzero(np.arange(D) != slow)
            fastest = others[np.argsort(self.makespan[others])[:4]]
            extra = self.rng.choice(others, size=min(4, len(others)), replace=False)
            candidates.append(self._swap_moves(slow, np.unique(np.concatenate([fastest, extra]))))
        # Screen: the bound of the new worst of the ranks a move touches.
        screened = []
        for mine, theirs, who in candidates:
            score = pipeline_lower_bounds(*self.times(mine), self.latency)
            if theirs is not None:
                score = np.maximum(score, pipeline_lower_bounds(*self.times(theirs), self.latency))
            screened.append(score)
        scores = np.concatenate(screened)
        top = np.argsort(scores, kind="stable")[:EXACT_PER_ROUND]
        top = top[scores[top] < current * (1 - 1e-12)]
        if not len(top):
            return False
        own_n = len(own)
        mine = np.concatenate([own, candidates[1][0]]) if D > 1 else own
        exact_mine = makespans(*self.times(mine[top]), self.latency)
        swap = top >= own_n
        exact_theirs = np.zeros(len(top))
        if swap.any():
            theirs, who = candidates[1][1], candidates[1][2]
            exact_theirs[swap] = makespans(*self.times(theirs[top[swap] - own_n]), self.latency)
        worst = np.maximum(exact_mine, exact_theirs)
        k = int(np.argmin(worst))
        if worst[k] >= current * (1 - 1e-12):
            return False
        self.plan[slow], self.makespan[slow] = mine[top[k]], exact_mine[k]
        if swap[k]:
            j = top[k] - own_n
            self.plan[who[j]], self.makespan[who[j]] = theirs[j], exact_theirs[k]
        return True


def plan_ours(instance, rng: np.random.Generator, budget_s: float = 0.035, sample: int = 512) -> np.ndarray:
    """int[D, M, S]: sequence ids per rank, microbatches in execution order (see module docstring)."""
    start = time.perf_counter()
    D, M, S, model = instance.D, instance.M, instance.S, instance.model
    seq_fwd, seq_bwd = model.stage_times(instance.costs)  # float[P, B]
    starts = [_vector_start(seq_fwd, seq_bwd, D, M, S), _scalar_start(instance)]
    searches = [_Search(plan, seq_fwd, seq_bwd, model.p2p_latency, rng, sample) for plan in starts]
    search = min(searches, key=lambda s: s.makespan.max())
    while time.perf_counter() - start < budget_s and search.improve():
        pass
    return search.plan
