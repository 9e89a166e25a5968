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
    """A plan under search: plan int[D, M, S], every rank's stage times float[D, P, M] (fwd, bwd)
    and exact makespan. Candidate moves are built as stage times directly (a move changes one or
    two microbatch columns), so thousands of them cost a few array operations."""

    def __init__(self, plan: np.ndarray, seq_fwd: np.ndarray, seq_bwd: np.ndarray, latency: float,
                 rng: np.random.Generator, sample: int):
        self.plan, self.seq_fwd, self.seq_bwd, self.latency = plan, seq_fwd, seq_bwd, latency
        self.rng, self.sample = rng, sample
        self.fwd = seq_fwd[:, plan].sum(axis=-1).transpose(1, 0, 2)
        self.bwd = seq_bwd[:, plan].sum(axis=-1).transpose(1, 0, 2)
        self.makespan = makespans(self.fwd, self.bwd, latency)

    def _pairs(self, n: int, m: int, *, distinct: bool) -> np.ndarray:
        """Up to ``sample`` index pairs (a < n, b < m), all of them when there are few enough."""
        total = n * m
        if total <= self.sample:
            a, b = np.divmod(np.arange(total), m)
        else:
            a, b = self.rng.integers(0, n, self.sample), self.rng.integers(0, m, self.sample)
        keep = a < b if distinct else np.ones(a.shape, dtype=bool)
        return np.column_stack([a[keep], b[keep]])

    def _exchange(self, rank: int, pos: np.ndarray, new_ids: np.ndarray):
        """Stage times of ``rank`` with the sequence at flat position pos[k] replaced by new_ids[k]."""
        S = self.plan.shape[2]
        old_ids = self.plan[rank].ravel()[pos]
        rows, cols = np.arange(len(pos)), pos // S
        out = []
        for base, seq in ((self.fwd, self.seq_fwd), (self.bwd, self.seq_bwd)):
            times = np.repeat(base[rank][None], len(pos), axis=0)
            times[rows, :, cols] += (seq[:, new_ids] - seq[:, old_ids]).T
            out.append(times)
        return out

    def _moves(self, slow: int) -> list[tuple]:
        """Candidate moves on the slowest rank, as (kind, args, stage times of the touched ranks)."""
        D, M, S = self.plan.shape
        moves = []
        pairs = self._pairs(M, M, distinct=True)  # swap two microbatches in the order
        if len(pairs):
            rows = np.arange(len(pairs))
            times = []
            for base in (self.fwd, self.bwd):
                t = np.repeat(base[slow][None], len(pairs), axis=0)
                t[rows, :, pairs[:, 0]], t[rows, :, pairs[:, 1]] = base[slow][:, pairs[:, 1]].T, base[slow][:, pairs[:, 0]].T
                times.append(t)
            moves.append(("order", pairs, times, None))
        flat = self.plan[slow].ravel()
        if S > 1:  # swap two of its sequences between microbatches
            pos = self._pairs(M * S, M * S, distinct=True)
            pos = pos[pos[:, 0] // S != pos[:, 1] // S]
            if len(pos):
                f1, b1 = self._exchange(slow, pos[:, 0], flat[pos[:, 1]])
                rows, cols = np.arange(len(pos)), pos[:, 1] // S
                f1[rows, :, cols] += (self.seq_fwd[:, flat[pos[:, 0]]] - self.seq_fwd[:, flat[pos[:, 1]]]).T
                b1[rows, :, cols] += (self.seq_bwd[:, flat[pos[:, 0]]] - self.seq_bwd[:, flat[pos[:, 1]]]).T
                moves.append(("inside", pos, (f1, b1), None))
        if D > 1:  # swap one of its sequences with one of another rank's
            others = np.flatnonzero(np.arange(D) != slow)
            fastest = others[np.argsort(self.makespan[others])[:4]]
            extra = self.rng.choice(others, size=min(4, len(others)), replace=False)
            partners = np.unique(np.concatenate([fastest, extra]))
            n = M * S
            pairs = self._pairs(n, n * len(partners), distinct=False)
            who, a, b = partners[pairs[:, 1] // n], pairs[:, 0], pairs[:, 1] % n
            theirs_ids = self.plan.reshape(D, n)[who, b]
            mine = self._exchange(slow, a, theirs_ids)
            theirs = []
            for base, seq in ((self.fwd, self.seq_fwd), (self.bwd, self.seq_bwd)):
                t = base[who].copy()
                t[np.arange(len(who)), :, b // S] += (seq[:, flat[a]] - seq[:, theirs_ids]).T
                theirs.append(t)
            moves.append(("across", np.column_stack([who, a, b]), mine, theirs))
        return moves

    def _apply(self, slow: int, kind: str, args: np.ndarray) -> None:
        D, M, S = self.plan.shape
        if kind == "order":
            i, j = args
            self.plan[slow, [i, j]] = self.plan[slow, [j, i]]
        elif kind == "inside":
            flat = self.plan[slow].reshape(-1)
            flat[[args[0], args[1]]] = flat[[args[1], args[0]]]
        else:
            who, a, b = (int(x) for x in args)
            mine, theirs = self.plan[slow].reshape(-1), self.plan[who].reshape(-1)
            mine[a], theirs[b] = theirs[b], mine[a]

    def _refresh(self, rank: int, fwd: np.ndarray, bwd: np.ndarray, span: float) -> None:
        self.fwd[rank], self.bwd[rank], self.makespan[rank] = fwd, bwd, span

    def improve(self) -> bool:
        """One round on the slowest rank; False when no candidate improves it (a local optimum)."""
        slow = int(np.argmax(self.makespan))
        current = self.makespan[slow] * (1 - 1e-12)
        moves = self._moves(slow)
        if not moves:
            return False
        # Screen every candidate with the bound of the new worst of the ranks it touches ...
        scores = []
        for _, _, (f, b), theirs in moves:
            score = pipeline_lower_bounds(f, b, self.latency)
            if theirs is not None:
                score = np.maximum(score, pipeline_lower_bounds(*theirs, self.latency))
            scores.append(score)
        flat_scores = np.concatenate(scores)
        owner = np.repeat(np.arange(len(moves)), [len(s) for s in scores])
        index = np.concatenate([np.arange(len(s)) for s in scores])
        top = np.argsort(flat_scores, kind="stable")[:EXACT_PER_ROUND]
        top = top[flat_scores[top] < current]
        # ... and run the most promising through the exact simulator, in one batch.
        if not len(top):
            return False
        P, M = self.fwd.shape[1:]
        touched_f, touched_b, who_of = [], [], []
        for k in top:
            _, args, (f, b), theirs = moves[owner[k]]
            touched_f.append(f[index[k]])
            touched_b.append(b[index[k]])
            if theirs is not None:
                touched_f.append(theirs[0][index[k]])
                touched_b.append(theirs[1][index[k]])
            who_of.append(len(touched_f))
        spans = makespans(np.stack(touched_f), np.stack(touched_b), self.latency)
        best, start = (current, None), 0
        for k, end in zip(top, who_of):
            worst = spans[start:end].max()
            if worst < best[0]:
                kind, args, (f, b), theirs = moves[owner[k]]
                i = index[k]
                best = (worst, (kind, args[i], f[i], b[i], spans[start],
                                theirs and (theirs[0][i], theirs[1][i], spans[end - 1])))
            start = end
        if best[1] is None:
            return False
        kind, args, f, b, span, theirs = best[1]
        self._apply(slow, kind, args)
        self._refresh(slow, f, b, span)
        if theirs:
            self._refresh(int(args[0]), *theirs)
        return True


def default_rounds(P: int, M: int) -> int:
    """Search rounds that fit the service's planning budget (tens of ms per 1024 sequences on one
    core): a round's cost grows with the P * M ops the simulator runs per candidate."""
    return max(2, min(8, 768 // (P * M)))


def plan_ours(instance, rng: np.random.Generator, rounds: int | None = None, sample: int = 256,
              budget_s: float | None = None) -> np.ndarray:
    """int[D, M, S]: sequence ids per rank, microbatches in execution order (see module docstring).

    The search stops after ``rounds`` improving rounds (default_rounds when None) or at a local
    optimum, so the plan is a
    deterministic function of the instance and ``rng``'s seed (replicas and restarted trainers
    re-plan a step and must get the same data). ``budget_s`` adds a wall-clock cap for offline use;
    with it the plan depends on the machine's speed."""
    start = time.perf_counter()
    D, M, S, model = instance.D, instance.M, instance.S, instance.model
    seq_fwd, seq_bwd = model.stage_times(instance.costs)  # float[P, B]
    starts = [_vector_start(seq_fwd, seq_bwd, D, M, S), _scalar_start(instance)]
    searches = [_Search(plan, seq_fwd, seq_bwd, model.p2p_latency, rng, sample) for plan in starts]
    search = min(searches, key=lambda s: s.makespan.max())
    for _ in range(default_rounds(model.num_stages, M) if rounds is None else rounds):
        if budget_s is not None and time.perf_counter() - start > budget_s:
            break
        if not search.improve():
            break
    return search.plan
