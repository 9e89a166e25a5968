"""Lower bounds that any plan must respect, to judge plans by their gap rather than by eye.

All work values are seconds. Stage work is additive over the sequences of a microbatch (module
time of a microbatch = sum of its sequences' module times), as in the cost model.
"""

from __future__ import annotations

import numpy as np

from preprocess_service.simulate import StageModel


def slot_lower_bound(costs: np.ndarray, num_ranks: int, per_rank: int) -> float:
    """Bound on the max rank load of any split of ``costs`` into ``num_ranks`` groups of ``per_rank``
    items: at least the mean load, and at least the largest item plus the ``per_rank - 1`` smallest
    others (the rank holding the largest item holds that many more)."""
    costs = np.sort(np.asarray(costs, dtype=float))
    if costs.size != num_ranks * per_rank:
        raise ValueError(f"{costs.size} costs cannot be split into {num_ranks} ranks x {per_rank}")
    return float(max(costs.sum() / num_ranks, costs[-1] + costs[:per_rank - 1].sum()))


def rank_lower_bound(fwd: np.ndarray, bwd: np.ndarray, p2p_latency: float = 0.0, *,
                     fixed_order: bool = True) -> float:
    """Makespan bound for one rank's pipeline (fwd, bwd float[P, M]).

    Every stage s runs all its work; before its first op a microbatch must pass forward through
    stages < s (fill), after its last op that microbatch's backward must pass through stages < s
    (drain). With ``fixed_order`` the first and last microbatches are columns 0 and M-1; otherwise
    the bound holds for any order of the microbatches (cheapest fill and drain)."""
    fwd, bwd = np.asarray(fwd, dtype=float), np.asarray(bwd, dtype=float)
    P, M = fwd.shape
    fill = np.vstack([np.zeros(M), np.cumsum(fwd, axis=0)[:-1]]) + np.arange(P)[:, None] * p2p_latency
    drain = np.vstack([np.zeros(M), np.cumsum(bwd, axis=0)[:-1]]) + np.arange(P)[:, None] * p2p_latency
    work = fwd.sum(axis=1) + bwd.sum(axis=1)
    if fixed_order:
        around = fill[:, 0] + drain[:, -1] if M > 1 else fill[:, 0] + drain[:, 0]
    else:
        around = fill.min(axis=1) + drain.min(axis=1)
    one_microbatch = (fwd + bwd).sum(axis=0).max() + 2 * (P - 1) * p2p_latency
    return float(max((work + around).max(), one_microbatch))


def batch_lower_bound(seq_module_fwd: np.ndarray, model: StageModel, *, D: int, M: int, S: int) -> float:
    """Iteration-time bound valid for any plan of the whole batch (seq_module_fwd float[B, 3]).

    The slowest of D ranks does at least 1/D of each stage's total work, plus the cheapest possible
    fill and drain (a microbatch holds S sequences: at least the S cheapest); and no microbatch
    passes the pipeline faster than the largest sequence alone does."""
    seq_module_fwd = np.asarray(seq_module_fwd, dtype=float)
    if seq_module_fwd.shape != (D * M * S, 3):
        raise ValueError(f"expected float[{D * M * S}, 3] sequence module times, got {seq_module_fwd.shape}")
    fwd, bwd = model.stage_times(seq_module_fwd)  # float[P, B]: per sequence
    P = model.num_stages
    lat = np.arange(P) * model.p2p_latency
    fill_per_seq = np.vstack([np.zeros(fwd.shape[1]), np.cumsum(fwd, axis=0)[:-1]])
    drain_per_seq = np.vstack([np.zeros(bwd.shape[1]), np.cumsum(bwd, axis=0)[:-1]])
    cheapest_fill = np.sort(fill_per_seq, axis=1)[:, :S].sum(axis=1) + lat
    cheapest_drain = np.sort(drain_per_seq, axis=1)[:, :S].sum(axis=1) + lat
    work = (fwd.sum(axis=1) + bwd.sum(axis=1)) / D
    one_sequence = (fwd + bwd).sum(axis=0).max() + 2 * (P - 1) * model.p2p_latency
    return float(max((work + cheapest_fill + cheapest_drain).max(), one_sequence))
