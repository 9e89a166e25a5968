"""Our whole-batch planner: vector balancing, microbatch formation, and a simulator-in-the-loop
local search within a time budget.

1. Ranks: every sequence has a work vector over the P pipeline stages (forward + backward seconds
   of the module share each stage runs). Sequences, largest bottleneck first, go to the rank (with
   room: M*S per rank) whose worst stage stays lowest, so encoder, backbone and generator loads are
   balanced as a vector, not as their sum.
2. Microbatches: each rank's sequences are dealt the same way into M microbatches of S, so the
   stage times of its microbatches come out even (which sequences share a microbatch is decided
   here, not inherited from arrival order).
3. Order: cheapest fill first, cheapest drain last, the rest by the paper's organ pipe.
   Steps 1-3 are one starting plan; the scalar `lpt` + `paper` plan is the other; the search
   starts from whichever the simulator says is faster, so ours is never worse than `lpt`.
4. Local search on the exact (vectorised) 1F1B simulator, always on the currently slowest rank:
   reorder its microbatches (swap two positions) or swap one of its sequences with one of a fast
   rank's; the best improving candidate of each round is kept, until no move improves or the budget
   is spent. Ranks meet at the all-reduce, so the objective is the slowest rank's makespan.
"""

from __future__ import annotations

import time

import numpy as np

from preprocess_service import reorder
from preprocess_service.simulate import makespans


def _vector_lpt(work: np.ndarray, items: np.ndarray, bins: int, per_bin: int) -> np.ndarray:
    """int[bins, per_bin]: items (rows of work float[n, P]) largest bottleneck first, each to the
    bin with room whose worst stage after adding it is lowest (ties: lowest total)."""
    out = np.empty((bins, per_bin), dtype=np.int64)
    load = np.zeros((bins, work.shape[1]))
    count = np.zeros(bins, dtype=np.int64)
    key = work[items].max(axis=1) + 1e-9 * work[items].sum(axis=1)
    for item in items[np.argsort(-key, kind="stable")]:
        trial = load + work[item]
        score = trial.max(axis=1) + 1e-6 * trial.sum(axis=1)
        score[count >= per_bin] = np.inf
        chosen = int(np.argmin(score))
        out[chosen, count[chosen]] = item
        count[chosen] += 1
        load[chosen] = trial[chosen]
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


class _State:
    """A plan under search: plan int[D, M, S] plus cached per-rank stage times and makespans."""

    def __init__(self, plan: np.ndarray, seq_fwd: np.ndarray, seq_bwd: np.ndarray, latency: float):
        self.plan, self.seq_fwd, self.seq_bwd, self.latency = plan, seq_fwd, seq_bwd, latency
        self.makespan = makespans(*self.times(plan), latency)

    def times(self, plans: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """plans int[R, M, S] -> stage times float[R, P, M] (fwd, bwd)."""
        fwd = self.seq_fwd[:, plans].sum(axis=-1).transpose(1, 0, 2)
        bwd = self.seq_bwd[:, plans].sum(axis=-1).transpose(1, 0, 2)
        return fwd, bwd


def _order_moves(state: _State, rank: int) -> np.ndarray:
    """Candidate plans of ``rank`` with two microbatch positions swapped: int[K, M, S]."""
    M = state.plan.shape[1]
    pairs = [(i, j) for i in range(M) for j in range(i + 1, M)]
    cands = np.repeat(state.plan[rank][None], len(pairs), axis=0)
    for k, (i, j) in enumerate(pairs):
        cands[k, [i, j]] = cands[k, [j, i]]
    return cands


def _swap_moves(state: _State, slow: int, fast: int, rng: np.random.Generator, limit: int):
    """Candidate (slow, fast) plan pairs with one sequence exchanged between the two ranks."""
    M, S = state.plan.shape[1:]
    n = M * S
    pairs = np.array([(a, b) for a in range(n) for b in range(n)])
    if len(pairs) > limit:
        pairs = pairs[rng.choice(len(pairs), limit, replace=False)]
    slow_c = np.repeat(state.plan[slow].reshape(1, n), len(pairs), axis=0)
    fast_c = np.repeat(state.plan[fast].reshape(1, n), len(pairs), axis=0)
    rows = np.arange(len(pairs))
    a, b = pairs[:, 0], pairs[:, 1]
    slow_c[rows, a], fast_c[rows, b] = state.plan[fast].ravel()[b], state.plan[slow].ravel()[a]
    return slow_c.reshape(-1, M, S), fast_c.reshape(-1, M, S)


def _improve_once(state: _State, rng: np.random.Generator, swap_limit: int) -> bool:
    slow = int(np.argmax(state.makespan))
    current = state.makespan[slow]
    best_gain, best = 0.0, None
    orders = _order_moves(state, slow)
    if len(orders):
        spans = makespans(*state.times(orders), state.latency)
        k = int(np.argmin(spans))
        if current - spans[k] > best_gain:
            best_gain, best = current - spans[k], ((slow, orders[k], spans[k]),)
    for fast in np.argsort(state.makespan)[:2]:
        if fast == slow:
            continue
        slow_c, fast_c = _swap_moves(state, slow, int(fast), rng, swap_limit)
        spans = makespans(*state.times(np.concatenate([slow_c, fast_c])), state.latency)
        worst = np.maximum(spans[:len(slow_c)], spans[len(slow_c):])
        k = int(np.argmin(worst))
        if current - worst[k] > best_gain:
            best_gain = current - worst[k]
            best = ((slow, slow_c[k], spans[k]), (int(fast), fast_c[k], spans[len(slow_c) + k]))
    if best is None or best_gain <= 1e-12 * current:
        return False
    for rank, plan, span in best:
        state.plan[rank], state.makespan[rank] = plan, span
    return True


def _vector_start(seq_fwd: np.ndarray, seq_bwd: np.ndarray, D: int, M: int, S: int) -> np.ndarray:
    work = (seq_fwd + seq_bwd).T
    plan = np.empty((D, M, S), dtype=np.int64)
    for rank, items in enumerate(_vector_lpt(work, np.arange(D * M * S), D, M * S)):
        mbs = _vector_lpt(work, items, M, S)
        fwd, bwd = seq_fwd[:, mbs].sum(axis=-1), seq_bwd[:, mbs].sum(axis=-1)
        plan[rank] = mbs[_initial_order(fwd, bwd)]
    return plan


def _scalar_start(instance) -> np.ndarray:
    return reorder.plan_batch(instance.totals, D=instance.D, M=instance.M, S=instance.S, intra="lpt",
                              inter="paper", rng=None)


def plan_ours(instance, rng: np.random.Generator, budget_s: float = 0.03, swap_limit: int = 256) -> np.ndarray:
    """int[D, M, S]: sequence ids per rank, microbatches in execution order (see module docstring)."""
    start = time.perf_counter()
    D, M, S, model = instance.D, instance.M, instance.S, instance.model
    seq_fwd, seq_bwd = model.stage_times(instance.costs)  # float[P, B]
    starts = [_vector_start(seq_fwd, seq_bwd, D, M, S), _scalar_start(instance)]
    states = [_State(plan, seq_fwd, seq_bwd, model.p2p_latency) for plan in starts]
    state = min(states, key=lambda st: st.makespan.max())
    while time.perf_counter() - start < budget_s and _improve_once(state, rng, swap_limit):
        pass
    return state.plan
