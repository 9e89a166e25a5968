"""``paper``: DistTrain's two heuristics (SIGCOMM'25), intra- and inter-microbatch reordering on
the scalar fwd+bwd cost of each sequence."""

from __future__ import annotations

import numpy as np

from preprocess_service.core.reorder import inter, intra, scalar_planner
from preprocess_service.core.reorder._greedy import check_intra_input, lpt_equal_counts


@intra("paper")
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
    check_intra_input(costs, D, M, S)
    plan = np.empty((D, M, S), dtype=np.int64)
    loads = np.zeros(D)
    for m in range(M):
        plan[:, m, :] = lpt_equal_counts(costs, np.arange(m * D * S, (m + 1) * D * S), D, S, loads)
    return plan


@inter("paper")
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


scalar_planner("paper", intra="paper", inter="paper")
