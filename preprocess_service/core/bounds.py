"""Lower bounds that any plan must respect, to judge plans by their gap rather than by eye.

All work values are seconds. Stage work is additive over the sequences of a microbatch (module
time of a microbatch = sum of its sequences' module times), as in the cost model.

Two kinds of pipeline bound, each taken over every stage, the larger one wins:

* **busiest stage**: a stage runs all its work, after the first microbatch's forward has passed the
  stages before it (fill) and before the last microbatch's backward passes them again (drain).
* **last stage coupling** (1F1B's limited in-flight microbatches): the last stage Y runs F(m), B(m)
  back to back, as one block Y(m) of length c_m. An op of stage s can only run while Y is busy with
  the ``P - s - 1`` blocks between its dependencies: F_s(k) lies between the end of
  Y(k - P + s) (F_s(k) follows B_s(k - P + s) on its stage, which waits for that block) and the start
  of Y(k); B_s(k) between the end of Y(k) and the start of Y(k + P - s). So while Y runs block m,
  stage s can overlap it with at most F_s(m+1 .. m+P-s-1) and B_s(m-P+s+1 .. m-1), and the makespan is
  at least fill + (work of s + work of Y - overlap) + drain. A heavy generator microbatch therefore
  cannot hide behind backbone work the way a pure stage-load bound assumes, and balancing stage loads
  as independent sums is not enough.
"""

from __future__ import annotations

import numpy as np

from disttrain_api.layout import StageModel


def slot_lower_bound(costs: np.ndarray, num_ranks: int, per_rank: int) -> float:
    """Bound on the max rank load of any split of ``costs`` into ``num_ranks`` groups of ``per_rank``
    items: at least the mean load, and at least the largest item plus the ``per_rank - 1`` smallest
    others (the rank holding the largest item holds that many more)."""
    costs = np.sort(np.asarray(costs, dtype=float))
    if costs.size != num_ranks * per_rank:
        raise ValueError(f"{costs.size} costs cannot be split into {num_ranks} ranks x {per_rank}")
    return float(max(costs.sum() / num_ranks, costs[-1] + costs[:per_rank - 1].sum()))


def max_bin_lower_bound(weights: np.ndarray, num_bins: int, per_bin: int) -> float:
    """Bound on the heaviest of ``num_bins`` bins of exactly ``per_bin`` items each (weights >= 0):
    the mean, and by pigeonhole, for every j, some bin holds j + 1 of the j * num_bins + 1 heaviest
    items, so it weighs at least the j + 1 lightest of those plus the per_bin - j - 1 lightest items."""
    w = np.sort(np.asarray(weights, dtype=float))[::-1]
    best = w.sum() / num_bins
    light = np.concatenate([[0.0], np.cumsum(w[::-1])])  # light[k] = sum of the k lightest
    for j in range(per_bin):
        k = j * num_bins + 1
        if k > w.size:
            break
        best = max(best, w[k - j - 1:k].sum() + light[per_bin - j - 1])
    return float(best)


def pipeline_lower_bounds(fwd: np.ndarray, bwd: np.ndarray, p2p_latency: float = 0.0) -> np.ndarray:
    """Makespan bounds of many pipelines with their microbatch order fixed: fwd, bwd float[R, P, M]
    -> float[R]. Busiest stage with fill and drain, the last stage coupling (module docstring), and
    one microbatch's round trip. A few whole-array operations whatever M is, so a planner can screen
    thousands of candidate plans with it before it runs the exact simulator on the best."""
    fwd, bwd = np.asarray(fwd, dtype=float), np.asarray(bwd, dtype=float)
    R, P, M = fwd.shape
    lat = np.arange(P) * p2p_latency
    fill = np.cumsum(fwd[:, :, 0], axis=1) - fwd[:, :, 0] + lat  # [R, P]: before stage s, microbatch 0
    drain = np.cumsum(bwd[:, :, -1], axis=1) - bwd[:, :, -1] + lat  # after stage s, the last one
    work = fwd.sum(axis=2) + bwd.sum(axis=2)  # [R, P]
    best = np.maximum((work + fill + drain).max(axis=1),
                      (fwd + bwd).sum(axis=1).max(axis=1) + 2 * (P - 1) * p2p_latency)
    if P == 1:
        return best
    last = fwd[:, -1] + bwd[:, -1]  # [R, M]
    stage, m = np.arange(P - 1)[:, None], np.arange(M)[None, :]  # all coupled stages at once
    window = P - 1 - stage
    zero = np.zeros((R, P - 1, 1))
    b_cum = np.concatenate([zero, np.cumsum(bwd[:, :-1], axis=2)], axis=2)  # b_cum[k] = sum B(0..k-1)
    f_cum = np.concatenate([zero, np.cumsum(fwd[:, :-1], axis=2)], axis=2)
    cap = (b_cum[:, stage, m] - b_cum[:, stage, np.maximum(m - window, 0)]
           + f_cum[:, stage, np.minimum(m + 1 + window, M)] - f_cum[:, stage, m + 1])  # [R, P-1, M]
    overlap = np.minimum(last[:, None, :], cap).sum(axis=2)
    coupled = fill[:, :-1] + drain[:, :-1] + work[:, :-1] + work[:, -1:] - overlap
    return np.maximum(best, coupled.max(axis=1))


def rank_lower_bound(fwd: np.ndarray, bwd: np.ndarray, p2p_latency: float = 0.0, *,
                     fixed_order: bool = True) -> float:
    """Makespan bound for one rank's pipeline (fwd, bwd float[P, M]).

    With ``fixed_order`` the columns are the execution order (pipeline_lower_bounds). Otherwise the
    bound holds for any order of the microbatches: cheapest fill and drain, and each coupling window
    capped by the largest stage times."""
    fwd, bwd = np.asarray(fwd, dtype=float), np.asarray(bwd, dtype=float)
    if fixed_order:
        return float(pipeline_lower_bounds(fwd[None], bwd[None], p2p_latency)[0])
    P, M = fwd.shape
    fill = np.vstack([np.zeros(M), np.cumsum(fwd, axis=0)[:-1]]) + np.arange(P)[:, None] * p2p_latency
    drain = np.vstack([np.zeros(M), np.cumsum(bwd, axis=0)[:-1]]) + np.arange(P)[:, None] * p2p_latency
    work = fwd.sum(axis=1) + bwd.sum(axis=1)
    around = fill.min(axis=1) + drain.min(axis=1)
    best = max((work + around).max(), (fwd + bwd).sum(axis=0).max() + 2 * (P - 1) * p2p_latency)
    last = fwd[-1] + bwd[-1]
    for s in range(P - 1):
        window = P - s - 1
        cap = np.sort(fwd[s])[::-1][:window].sum() + np.sort(bwd[s])[::-1][:window].sum()
        best = max(best, around[s] + work[s] + last.sum() - np.minimum(last, cap).sum())
    return float(best)


def _max_overlap(last: np.ndarray, cap: float, groups: int, per_group: int) -> float:
    """Upper bound on sum over microbatches of min(c_m, cap) for any split of the per-sequence
    last-stage times ``last`` into ``groups`` microbatches of ``per_group``: a sequence with c >= cap
    saturates its microbatch alone, so at most min(k, groups) microbatches are saturated by the k such
    sequences, and the others hold only smaller ones, at best the largest of them."""
    large = last >= cap
    saturated = min(int(large.sum()), groups)
    rest = groups - saturated
    small = np.sort(last[~large])[::-1][:rest * per_group].sum()
    return saturated * cap + min(rest * cap, small)


def _min_deficit(last: np.ndarray, cap: float, groups: int) -> float:
    """Lower bound on sum over ``groups`` microbatches of max(0, cap - c_m), for any way of putting
    the sequences with last-stage times ``last`` into them (any others go elsewhere). With no more
    positive sequences than microbatches, one per microbatch is best (joining two never lowers the
    sum, and the remaining microbatches get nothing); otherwise every microbatch covers at most cap."""
    positive = np.sort(last[last > 0])[::-1]
    if positive.size <= groups:
        return float((groups - positive.size) * cap + np.maximum(0.0, cap - positive).sum())
    return float(max(0.0, groups * cap - np.minimum(positive, cap).sum()))


def batch_lower_bound(seq_module_fwd: np.ndarray, model: StageModel, *, D: int, M: int, S: int) -> float:
    """Iteration-time bound valid for any plan of the whole batch (seq_module_fwd float[B, 3]).

    The slowest of D ranks does at least 1/D of each stage's total work plus the mean fill and drain
    (the D first microbatches hold D*S distinct sequences: at least the D*S cheapest fills, and the
    same for drains), or by pigeonhole on the heaviest sequences (max_bin_lower_bound) more work
    plus the cheapest fill and drain of a single rank (a microbatch holds S sequences: at least the
    S cheapest); no microbatch passes
    the pipeline faster than the largest sequence alone does; and for the last stage coupling (module
    docstring) the overlap with any block is capped by the window*S largest sequence forwards and
    backwards of stage s, and min(c_m, cap) <= sum over its sequences of min(c_seq, cap), so each
    sequence contributes a fixed amount, bounded across ranks the same way; with S > 1 the overlap
    of all ranks together is also at most what the best split into microbatches allows (_max_overlap).
    A stage shared by g ranks (model.shared_by) is one replica's work for g ranks: the same terms
    over D / g replicas. Coupling only delays ops, so every per-rank term stays valid for it. A stage
    with k > 1 replicas per rank (model.split_by) runs ops in parallel: the per-stage terms are left
    out while any stage is split, or the last stage, whose terms assume one replica."""
    seq_module_fwd = np.asarray(seq_module_fwd, dtype=float)
    if seq_module_fwd.shape != (D * M * S, 3):
        raise ValueError(f"expected float[{D * M * S}, 3] sequence module times, got {seq_module_fwd.shape}")
    model.check_ranks(D)
    fwd, bwd = model.stage_times(seq_module_fwd)  # float[P, B]: per sequence
    P = model.num_stages
    lat = np.arange(P) * model.p2p_latency
    fill_per_seq = np.vstack([np.zeros(fwd.shape[1]), np.cumsum(fwd, axis=0)[:-1]])
    drain_per_seq = np.vstack([np.zeros(bwd.shape[1]), np.cumsum(bwd, axis=0)[:-1]])
    cheapest_fill = np.sort(fill_per_seq, axis=1)[:, :S].sum(axis=1) + lat
    cheapest_drain = np.sort(drain_per_seq, axis=1)[:, :S].sum(axis=1) + lat
    # The D ranks' first microbatches hold D*S distinct sequences, so their fills sum to at least
    # the D*S cheapest (the same for drains): the slowest rank is at least the mean rank.
    mean_fill = np.sort(fill_per_seq, axis=1)[:, :D * S].sum(axis=1) / D + lat
    mean_drain = np.sort(drain_per_seq, axis=1)[:, :D * S].sum(axis=1) / D + lat
    per_rank = M * S
    splits = model.stage_splits()  # a stage with k > 1 replicas per rank is not serial: no per-stage bound
    if P > 1 and M > 2 and splits[-1] == 1 and splits[-2] == 1:
        # The last stage waits while stage P-2 runs B(m-1) and F(m+1) (the coupling with window 1):
        # it spends at least max(c_m, cap_m) per interior microbatch m, cap_m >= the S cheapest.
        cap_low = np.sort(fwd[-2])[:S].sum() + np.sort(bwd[-2])[:S].sum()
        last_stage = (fwd[-1] + bwd[-1])
        deficit = _min_deficit(last_stage, cap_low, D * (M - 2))
        starved = mean_fill[-1] + mean_drain[-1] + (last_stage.sum() + deficit) / D
    else:
        starved = 0.0
    one_sequence = (fwd + bwd).sum(axis=0).max() + 2 * (P - 1) * model.p2p_latency
    best = max(one_sequence, starved)
    last = fwd[-1] + bwd[-1]
    groups = model.stage_groups()
    for s in range(P):
        if splits[s] > 1 or splits[-1] > 1:
            continue
        work = fwd[s] + bwd[s]
        best = max(best, cheapest_fill[s] + cheapest_drain[s] + max_bin_lower_bound(work, D, per_rank),
                   mean_fill[s] + mean_drain[s] + work.sum() / D)
        if groups[s] > 1:  # one replica runs the stage for groups[s] ranks: D / groups[s] bins
            replicas = D // groups[s]
            best = max(best, mean_fill[s] + mean_drain[s] + work.sum() / replicas,
                       cheapest_fill[s] + cheapest_drain[s] + max_bin_lower_bound(work, replicas, groups[s] * per_rank))
        if s == P - 1:
            break
        k = (P - s - 1) * S
        cap = np.sort(fwd[s])[::-1][:k].sum() + np.sort(bwd[s])[::-1][:k].sum()
        serial = work + last - np.minimum(last, cap)
        around = cheapest_fill[s] + cheapest_drain[s] - 2 * lat[s]
        mean_around = mean_fill[s] + mean_drain[s] - 2 * lat[s]
        best = max(best, around + max_bin_lower_bound(serial, D, per_rank), mean_around + serial.sum() / D)
        if S > 1:  # whole microbatches, not single sequences, fill an overlap window
            overlap = _max_overlap(last, cap, D * M, S)
            best = max(best, mean_around + (work.sum() + last.sum() - overlap) / D)
    return float(best)
