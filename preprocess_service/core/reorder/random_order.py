"""``random``: a seeded random assignment (a baseline: what reordering is worth over chance)."""

from __future__ import annotations

import numpy as np

from preprocess_service.core.reorder import intra, scalar_planner
from preprocess_service.core.reorder._greedy import check_intra_input


@intra("random")
def intra_random(costs: np.ndarray, D: int, M: int, S: int, rng: np.random.Generator) -> np.ndarray:
    """A seeded random permutation of the batch, then as arrival."""
    check_intra_input(costs, D, M, S)
    return rng.permutation(D * M * S).reshape(M, D, S).transpose(1, 0, 2).copy()


scalar_planner("random", intra="random", inter="arrival")
