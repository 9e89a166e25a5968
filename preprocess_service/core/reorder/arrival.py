"""``arrival``: no reordering, the baseline every report compares with."""

from __future__ import annotations

import numpy as np

from preprocess_service.core.reorder import inter, intra, scalar_planner
from preprocess_service.core.reorder._greedy import check_intra_input


@intra("arrival")
def intra_arrival(costs: np.ndarray, D: int, M: int, S: int, rng: np.random.Generator | None) -> np.ndarray:
    """No reordering: slot m's sequences go to ranks in arrival order, S each."""
    check_intra_input(costs, D, M, S)
    return np.arange(D * M * S).reshape(M, D, S).transpose(1, 0, 2).copy()


@inter("arrival")
def inter_arrival(microbatch_costs: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
    """Slot order as planned."""
    D, M = microbatch_costs.shape
    return np.tile(np.arange(M), (D, 1))


scalar_planner("arrival", intra="arrival", inter="arrival")
