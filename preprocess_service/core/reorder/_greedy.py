"""What the scalar planners share: the input check and the equal-count LPT greedy (compiled)."""

from __future__ import annotations

import numba as nb
import numpy as np


def check_intra_input(costs: np.ndarray, D: int, M: int, S: int) -> None:
    if costs.shape != (D * M * S,):
        raise ValueError(f"costs has shape {costs.shape}, expected ({D * M * S},) = D*M*S for "
                         f"D={D}, M={M}, S={S}")


def lpt_equal_counts(costs: np.ndarray, items: np.ndarray, bins: int, per_bin: int,
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
    """The greedy of lpt_equal_counts: each item to the bin with the lowest load among those with
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
