"""Our whole-batch planner: balancing the loads a 1F1B pipeline really waits on, as a vector;
microbatch formation; and a local search with the exact simulator in the loop, within a budget.

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
   Steps 1-3 are one starting plan; the scalar ``lpt`` + ``paper`` plan and ``paper``'s own plan are
   the others; the search starts from whichever the simulator says is fastest and only ever keeps
   improvements, so ours is never worse than ``lpt`` or ``paper``.
4. Local search with the exact simulator in the loop (simkernels.local_search, compiled): always on
   the slowest component (one rank; or the ranks coupled by a shared encoder/generator replica),
   draw a random move of one of its ranks (swap two microbatches in the order, move one to another
   position, swap two of its sequences between microbatches, or swap one of its sequences with
   another rank's, often one of the fastest component), simulate every component it touches
   exactly (about a microsecond for an independent rank: simkernels.simulate_flat), and keep it
   when the iteration gets shorter. The objective is the one the trainer has (simulate.py): the
   slowest rank's makespan when ranks meet only at the all-reduce, the slowest coupled
   component's when replicas are shared.
5. When the search reaches a local optimum before its budget is spent (small batches), it restarts
   from the best plan with a few random swaps between ranks (iterated local search), until the
   budget is spent or RESTARTS_WITHOUT_GAIN restarts in a row found nothing better.
   The budget is a fixed number of simulated ops per 1024 sequences (bench/reorder.py times it), and
   every random draw comes from the rng, so the plan is a function of the instance and the seed.
"""

from __future__ import annotations

import numpy as np

from disttrain_api.layout import StageModel
from preprocess_service.core import reorder, simkernels
from preprocess_service.core.reorder.instance import Instance
from preprocess_service.core.simulate import topological_order


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
    # first of each set of equal columns (np.unique(axis=1) does this too, but ten times slower)
    columns = np.round(np.vstack([loads, offsets]), 12) + 0.0  # + 0.0: -0.0 and 0.0 alike
    first: dict[bytes, int] = {}
    for k in range(columns.shape[1]):
        first.setdefault(columns[:, k].tobytes(), k)
    keep = np.array(sorted(first.values()))
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


def _initial_orders(fwd: np.ndarray, bwd: np.ndarray) -> np.ndarray:
    """fwd, bwd float[D, P, M] of each rank's microbatches -> int[D, M]: each rank's order, the
    paper's organ pipe by total time, then the cheapest fill first and the cheapest drain last."""
    D, P, M = fwd.shape
    rows = np.arange(D)[:, None]
    ascending = np.argsort((fwd + bwd).sum(axis=1), axis=1, kind="stable")
    if M <= 2:
        return ascending
    rest = ascending[:, 2:]
    order = np.concatenate([ascending[:, :1], rest[:, 0::2], rest[:, 1::2][:, ::-1], ascending[:, 1:2]], axis=1)
    fill = fwd[:, :-1].sum(axis=1) if P > 1 else fwd.sum(axis=1)
    drain = bwd[:, :-1].sum(axis=1) if P > 1 else bwd.sum(axis=1)
    first = np.argmin(fill, axis=1)[:, None]
    rest = order[order != first].reshape(D, M - 1)
    last = rest[rows[:, 0], np.argmin(drain[rows, rest], axis=1)][:, None]
    middle = rest[rest != last].reshape(D, M - 2)
    return np.concatenate([first, middle, last], axis=1)


def _vector_start(seq_fwd: np.ndarray, seq_bwd: np.ndarray, D: int, M: int, S: int) -> np.ndarray:
    loads, offsets = _load_terms(seq_fwd, seq_bwd, S)
    ranks = _deal_rounds(loads, offsets, np.arange(D * M * S)[None], D)[0]  # [D, M*S]
    stage_work = (seq_fwd + seq_bwd).T
    plan = _deal_rounds(stage_work, np.zeros(stage_work.shape[1]), ranks, M)  # [D, M, S]
    fwd = seq_fwd[:, plan].sum(axis=-1).transpose(1, 0, 2)  # [D, P, M]
    bwd = seq_bwd[:, plan].sum(axis=-1).transpose(1, 0, 2)
    return np.take_along_axis(plan, _initial_orders(fwd, bwd)[:, :, None], axis=1)


def _scalar_start(instance, intra: str) -> np.ndarray:
    """The plan of the scalar planner ``intra`` + ``paper`` (the registry's "lpt" or "paper")."""
    # lpt and paper never draw from rng (plan_batch's rng is typed for every algorithm, "random" included)
    return reorder.plan_batch(instance.totals, D=instance.D, M=instance.M, S=instance.S, intra=intra,
                              inter="paper", rng=None)  # type: ignore[arg-type]


SEARCH_OPS = 6_000_000
"""Default search budget per 1024 sequences of the batch (at least this much for smaller ones), in
simulated ops (2 P M per rank and candidate move): the same work per 1024 sequences whatever the
batch's shape, the service's planning budget (bench/reorder.py prints its milliseconds)."""
EVAL_OVERHEAD_OPS = 160
"""What drawing and applying one candidate move costs besides its simulation, in simulated ops."""


def plan_ours(instance, rng: np.random.Generator, ops: float | None = None, patience: int | None = None) -> np.ndarray:
    """int[D, M, S]: sequence ids per rank, microbatches in execution order (see module docstring).

    The search stops after ``ops`` simulated ops (default SEARCH_OPS per 1024 sequences) or
    ``patience`` failed moves in a row (default: a few times one rank's neighbourhood), so the plan
    is a deterministic function of the instance and ``rng``'s seed: replicas and restarted trainers
    re-plan a step and get the same data."""
    D, M, S, model = instance.D, instance.M, instance.S, instance.model
    model.check_ranks(D)
    seq_fwd, seq_bwd = model.stage_times(instance.costs)  # float[P, B]
    seq_fwd, seq_bwd = np.ascontiguousarray(seq_fwd), np.ascontiguousarray(seq_bwd)
    P, L, groups = model.num_stages, model.component, model.kernel_groups()
    if ops is None:
        ops = SEARCH_OPS * max(1.0, D * M * S / 1024)
    order = topological_order(P, M)

    def times(plan: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return (np.ascontiguousarray(seq_fwd[:, plan].sum(axis=-1).transpose(1, 0, 2)),
                np.ascontiguousarray(seq_bwd[:, plan].sum(axis=-1).transpose(1, 0, 2)))

    starts = [_vector_start(seq_fwd, seq_bwd, D, M, S), _scalar_start(instance, "lpt"),
              _scalar_start(instance, "paper")]
    latency = float(model.p2p_latency)
    spans = [simkernels.component_spans(*times(p), L, groups, *order, latency).max() for p in starts]
    plan = np.ascontiguousarray(starts[int(np.argmin(spans))], dtype=np.int64)
    F, B = times(plan)
    if patience is None:  # a few times the slowest rank's neighbourhood (with 8 partner ranks)
        patience = 4 * (M * M + (M * S) ** 2 + 8 * (M * S) ** 2)
    max_evals = int(ops // (2 * P * M * L + EVAL_OVERHEAD_OPS))
    best, best_span, spent, stale = plan, float(min(spans)), 0, 0
    while True:
        seed = int(rng.integers(0, 2**31 - 1))
        spent += simkernels.local_search(plan, seq_fwd, seq_bwd, F, B, L, groups, *order, latency, seed,
                                         max_evals - spent, int(patience))[1]
        span = float(simkernels.component_spans(F, B, L, groups, *order, latency).max())
        stale += 1
        if span < best_span:
            best, best_span, stale = plan, span, 0
        if spent >= max_evals or D < 2 or stale > RESTARTS_WITHOUT_GAIN:
            return best
        # a local optimum within the budget (small batches): iterated local search, restarting
        # from the best plan with a few random sequence swaps between ranks
        plan = _perturb(best, rng)
        F, B = times(plan)


def _perturb(plan: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A copy of ``plan`` with 1 in PERTURB_EVERY of its sequences swapped with a random rank's."""
    D, M, S = plan.shape
    flat = plan.reshape(D, M * S).copy()
    n = max(1, D * M * S // PERTURB_EVERY)
    ranks, slots = rng.integers(D, size=(n, 2)), rng.integers(M * S, size=(n, 2))
    for (a, b), (i, j) in zip(ranks.tolist(), slots.tolist()):
        flat[a, i], flat[b, j] = flat[b, j], flat[a, i]
    return np.ascontiguousarray(flat.reshape(D, M, S))


@reorder.planner("ours")
def _plan(instance, rng: np.random.Generator) -> np.ndarray:
    """The service default: a fixed budget of simulated ops per 1024 sequences (SEARCH_OPS; its CPU
    time is bench/reorder.py's figure)."""
    return plan_ours(instance, rng)


@reorder.planner("ours-deep")
def _plan_deep(instance, rng: np.random.Generator) -> np.ndarray:
    """``ours`` with 100 times the budget (offline: what more search buys)."""
    ops = 100 * SEARCH_OPS * max(1.0, instance.D * instance.M * instance.S / 1024)
    return plan_ours(instance, rng, ops=ops, patience=200_000)


PERTURB_EVERY = 50
RESTARTS_WITHOUT_GAIN = 8
"""The search ends early once this many restarts in a row found nothing better (tiny batches)."""


def warm_up() -> None:
    """Loads the compiled search kernels (or compiles them, seconds, once per installation: numba
    caches them beside the module), so that a service's first step is planned at full speed."""
    for shared in ((1, 1, 1), (2, 1, 1)):
        model = StageModel(stage_map=("enc", "bb", "gen"), shared_by=shared)
        plan_ours(Instance(D=2, M=2, S=2, model=model, costs=np.ones((8, 3))), np.random.default_rng(0))
