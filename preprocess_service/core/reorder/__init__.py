"""Reordering algorithms for one global batch, by name, so baselines and ours sit side by side.

Shapes (D = DP ranks, M = microbatches per rank, S = sequences per microbatch, B = D*M*S):

* intra algorithm: ``fn(costs: float[B], D, M, S, rng) -> int[D, M, S]``; a permutation of
  range(B) telling which sequences each rank gets in each microbatch slot. Slot m of the
  arrival order is sequences [m*D*S, (m+1)*D*S).
* inter algorithm: ``fn(microbatch_costs: float[D, M], rng) -> int[D, M]``; for each rank a
  permutation of its M microbatches, in execution order.

Only ``intra_random`` draws from ``rng``; the others take None as well.

Costs are the scalar fwd+bwd seconds of cost.SequenceCost.total_s.
"""

from __future__ import annotations

from collections.abc import Callable

import numba as nb
import numpy as np

IntraAlgorithm = Callable[[np.ndarray, int, int, int, np.random.Generator], np.ndarray]
InterAlgorithm = Callable[[np.ndarray, np.random.Generator], np.ndarray]


def _check_intra_input(costs: np.ndarray, D: int, M: int, S: int) -> None:
    if costs.shape != (D * M * S,):
        raise ValueError(f"costs has shape {costs.shape}, expected ({D * M * S},) = D*M*S for "
                         f"D={D}, M={M}, S={S}")


def intra_arrival(costs: np.ndarray, D: int, M: int, S: int, rng: np.random.Generator | None) -> np.ndarray:
    """No reordering: slot m's sequences go to ranks in arrival order, S each."""
    _check_intra_input(costs, D, M, S)
    return np.arange(D * M * S).reshape(M, D, S).transpose(1, 0, 2).copy()


def intra_random(costs: np.ndarray, D: int, M: int, S: int, rng: np.random.Generator) -> np.ndarray:
    """A seeded random permutation of the batch, then as arrival."""
    _check_intra_input(costs, D, M, S)
    return rng.permutation(D * M * S).reshape(M, D, S).transpose(1, 0, 2).copy()


def _lpt_equal_counts(costs: np.ndarray, items: np.ndarray, bins: int, per_bin: int,
                      loads: np.ndarray | None = None) -> np.ndarray:
    """Greedy LPT under a cardinality constraint: items by descending cost (stable: ties keep their
    order, so plans are deterministic), each to the least-loaded bin that still has room (ties: the
    lowest bin). ``loads`` (float[bins], default zeros): the bins' loads before these items; updated
    in place when given. Returns int[bins, per_bin] item ids."""
    if len(items) > bins * per_bin:
        raise ValueError(f"{len(items)} items do not fit {bins} bins of {per_bin}")
    out = np.empty((bins, per_bin), dtype=np.int64)
    ordered = np.ascontiguousarray(items[np.argsort(-costs[items], kind="stable")], dtype=np.int64)
    work = np.zeros(bins) if loads is None else loads
    if work.dtype != np.float64 or not work.flags.c_contiguous:
        raise ValueError("loads must be a contiguous float64 array")
    _lpt_kernel(ordered, np.ascontiguousarray(costs[ordered], dtype=np.float64), work, per_bin, out)
    return out


@nb.njit(cache=True, nogil=True)
def _lpt_kernel(ordered, ordered_costs, loads, per_bin, out):
    """The greedy of _lpt_equal_counts: each item to the bin with the lowest load among those with
    room, the lowest bin on a tie (the order a heap of (load, bin) pops)."""
    bins = loads.shape[0]
    count = np.zeros(bins, dtype=np.int64)
    for k in range(ordered.shape[0]):
        best = -1
        for b in range(bins):
            if count[b] < per_bin and (best < 0 or loads[b] < loads[best]):
                best = b
        out[best, count[best]] = ordered[k]
        count[best] += 1
        loads[best] += ordered_costs[k]


def intra_paper(costs: np.ndarray, D: int, M: int, S: int, rng: np.random.Generator | None) -> np.ndarray:
    """DistTrain's intra-microbatch reordering, as its talk states it: "sort in descending order;
    for each data sample, put it in the lowest load DP", to mitigate stragglers across the
    data-parallel instances (a data sample there is a training sequence: one entry of ``costs``).
    A rank's load is everything it has been given so far in the global batch, earlier microbatch
    slots included. Slot by slot (arrival order), the slot's sequences by cost descending, each to
    the rank with the lowest load so far that still has room (S per rank per slot; ties: the lowest
    rank). No sequence leaves its microbatch slot (the reordering is intra-microbatch; which
    microbatch runs when is the inter-microbatch step's).

    Loads are carried across slots, not restarted at zero in each: with one sequence per rank per
    slot (S = 1) every assignment of a slot is equally balanced within it, so a per-slot greedy
    only follows its tie-break and deals the largest sequence of every slot to rank 0. The
    instances the paper balances are the ranks, whose totals the gradient all-reduce waits on.
    Deterministic: no draws, stable ties."""
    _check_intra_input(costs, D, M, S)
    plan = np.empty((D, M, S), dtype=np.int64)
    loads = np.zeros(D)
    for m in range(M):
        plan[:, m, :] = _lpt_equal_counts(costs, np.arange(m * D * S, (m + 1) * D * S), D, S, loads)
    return plan


def intra_lpt(costs: np.ndarray, D: int, M: int, S: int, rng: np.random.Generator | None) -> np.ndarray:
    """Balances what the ranks wait on at the gradient all-reduce: each rank's total. Whole-batch
    LPT with equal counts (M*S sequences per rank), then each rank's sequences dealt the same way to
    its M microbatches so they come out even. Unlike the paper's greedy, which keeps every
    sequence in its arrival slot, it decides which sequences share a microbatch. Falls back
    to the arrival plan in the rare batch where that is better balanced."""
    _check_intra_input(costs, D, M, S)
    plan = np.empty((D, M, S), dtype=np.int64)
    for rank, items in enumerate(_lpt_equal_counts(costs, np.arange(D * M * S), D, M * S)):
        plan[rank] = _lpt_equal_counts(costs, items, M, S)
    arrival = intra_arrival(costs, D, M, S, rng)
    return arrival if imbalance(costs, arrival) < imbalance(costs, plan) else plan


def inter_arrival(microbatch_costs: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
    """Slot order as planned."""
    D, M = microbatch_costs.shape
    return np.tile(np.arange(M), (D, 1))


def inter_paper(microbatch_costs: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
    """DistTrain's inter-microbatch reordering: 1F1B adds the first and last microbatches' time
    straight to the iteration (warm-up and cool-down), while steady-state intervals absorb
    stragglers. So: the cheapest microbatch first, the second cheapest last, and the rest with
    the most expensive in the middle, decreasing towards both ends."""
    D, M = microbatch_costs.shape
    order = np.empty((D, M), dtype=np.int64)
    for rank in range(D):
        ascending = list(np.argsort(microbatch_costs[rank], kind="stable"))
        if M <= 2:
            order[rank] = ascending
            continue
        first, last, rest = ascending[0], ascending[1], ascending[2:]
        # Organ pipe: alternate the ascending rest to the left and right half, largest ends centred.
        left, right = rest[0::2], rest[1::2]
        order[rank] = [first, *left, *reversed(right), last]
    return order


INTRA_ALGORITHMS: dict[str, IntraAlgorithm] = {
    "arrival": intra_arrival,
    "random": intra_random,
    "paper": intra_paper,
    "lpt": intra_lpt,
}

INTER_ALGORITHMS: dict[str, InterAlgorithm] = {
    "arrival": inter_arrival,
    "paper": inter_paper,
}


def plan_batch(costs: np.ndarray, *, D: int, M: int, S: int, intra: str, inter: str,
               rng: np.random.Generator) -> np.ndarray:
    """Both reorderings: int[D, M, S] sequence ids, microbatches in each rank's execution order."""
    assignment = INTRA_ALGORITHMS[intra](costs, D, M, S, rng)
    order = INTER_ALGORITHMS[inter](costs[assignment].sum(axis=2), rng)
    return np.take_along_axis(assignment, order[:, :, None], axis=1)


def imbalance(costs: np.ndarray, plan: np.ndarray) -> float:
    """max / mean of the per-rank total load (1.0 = perfectly balanced)."""
    loads = costs[plan].sum(axis=(1, 2))
    mean = loads.mean()
    return float(loads.max() / mean) if mean > 0 else 1.0


def warm_up() -> None:
    """Compiles the planners' numba kernels, or loads them from numba's on-disk cache (compiled once
    per installation, loaded after; bench/reorder.py times both), by planning two tiny batches with every
    signature the planners use, so that a process plans its first real batch at full speed. Call it
    when a service or CLI starts, not on a job's first step."""
    from preprocess_service.core.reorder import ours  # imported late: ours imports this package

    ours.warm_up()
