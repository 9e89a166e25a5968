"""``lpt``: the ranks' totals balanced by whole-batch LPT, then the paper's microbatch order."""

from __future__ import annotations

import numpy as np

from preprocess_service.core.reorder import imbalance, intra, scalar_planner
from preprocess_service.core.reorder._greedy import check_intra_input, lpt_equal_counts
from preprocess_service.core.reorder.arrival import intra_arrival


@intra("lpt")
def intra_lpt(costs: np.ndarray, D: int, M: int, S: int, rng: np.random.Generator | None) -> np.ndarray:
    """Balances what the ranks wait on at the gradient all-reduce: each rank's total. Whole-batch
    LPT with equal counts (M*S sequences per rank), then each rank's sequences dealt the same way to
    its M microbatches so they come out even. Unlike the paper's greedy, which keeps every
    sequence in its arrival slot, it decides which sequences share a microbatch. Falls back
    to the arrival plan in the rare batch where that is better balanced."""
    check_intra_input(costs, D, M, S)
    plan = np.empty((D, M, S), dtype=np.int64)
    for rank, items in enumerate(lpt_equal_counts(costs, np.arange(D * M * S), D, M * S)):
        plan[rank] = lpt_equal_counts(costs, items, M, S)
    arrival = intra_arrival(costs, D, M, S, rng)
    return arrival if imbalance(costs, arrival) < imbalance(costs, plan) else plan


scalar_planner("lpt", intra="lpt", inter="paper")
