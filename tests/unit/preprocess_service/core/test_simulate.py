import itertools

import numpy as np
import pytest

from disttrain_api.layout import StageModel, stage_order
from preprocess_service.core import reorder
from preprocess_service.core.bounds import batch_lower_bound, pipeline_lower_bounds, rank_lower_bound, slot_lower_bound
from preprocess_service.core.simulate import (
    component_makespans,
    iteration_time,
    makespans,
    rank_makespan,
    simulate_1f1b,
    simulate_coupled,
)


@pytest.mark.parametrize("P,M,f,b", [(1, 4, 1.0, 2.0), (4, 8, 1.0, 2.0), (4, 2, 1.0, 1.0), (8, 32, 0.5, 1.0),
                                     (3, 3, 1.0, 3.0), (4, 1, 2.0, 5.0)])
def test_uniform_stages_match_the_closed_form(P, M, f, b):
    t = simulate_1f1b(np.full((P, M), f), np.full((P, M), b))
    assert t.makespan == pytest.approx((M + P - 1) * (f + b))


def test_stage_order_is_warmup_steady_cooldown():
    assert stage_order(4, 6, 0) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1),
                                    ("F", 5), ("B", 2), ("B", 3), ("B", 4), ("B", 5)]
    assert stage_order(4, 6, 3)[:4] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


@pytest.mark.parametrize("seed", range(5))
def test_timeline_respects_every_dependency(seed):
    rng = np.random.default_rng(seed)
    P, M, lat = 4, 7, 0.1
    fwd, bwd = rng.uniform(0.5, 3, (P, M)), rng.uniform(0.5, 6, (P, M))
    t = simulate_1f1b(fwd, bwd, lat)
    eps = 1e-9
    assert (t.f_start[1:] >= t.f_end[:-1] + lat - eps).all()
    assert (t.b_start[:-1] >= t.b_end[1:] + lat - eps).all()
    assert (t.b_start[-1] >= t.f_end[-1] - eps).all()
    for s in range(P):  # ops of one stage never overlap and follow the 1F1B order
        spans = [(t.f_start[s, m], t.f_end[s, m]) if k == "F" else (t.b_start[s, m], t.b_end[s, m])
                 for k, m in stage_order(P, M, s)]
        assert all(a[1] <= b[0] + eps for a, b in zip(spans, spans[1:]))
    np.testing.assert_allclose(t.f_end - t.f_start, fwd)
    np.testing.assert_allclose(t.b_end - t.b_start, bwd)


def test_a_straggler_first_costs_more_than_in_the_middle():
    P, M = 4, 8
    fwd = np.ones((P, M))
    first, middle = fwd.copy(), fwd.copy()
    first[:, 0] = 3.0
    middle[:, 4] = 3.0
    assert simulate_1f1b(first, 2 * first).makespan > simulate_1f1b(middle, 2 * middle).makespan


def test_stage_model_maps_modules_to_stages():
    model = StageModel(stage_map=("enc", "bb/2", "bb/2", "gen"), bwd_factor=(0.0, 2.0, 1.0))
    fwd, bwd = model.stage_times(np.array([[1.0, 4.0, 3.0], [2.0, 6.0, 0.0]]))
    np.testing.assert_allclose(fwd, [[1, 2], [2, 3], [2, 3], [3, 0]])
    np.testing.assert_allclose(bwd, [[0, 0], [4, 6], [4, 6], [3, 0]])
    with pytest.raises(ValueError, match="'vit'"):
        StageModel(stage_map=("vit", "bb"))
    with pytest.raises(ValueError, match="'bb/0'"):
        StageModel(stage_map=("bb/0",))


def test_slot_bound_holds_for_every_equal_count_split():
    rng = np.random.default_rng(0)
    costs = rng.lognormal(0, 1, 6)
    best = min(max(costs[list(g)].sum(), costs[[i for i in range(6) if i not in g]].sum())
               for g in itertools.combinations(range(6), 3))
    assert slot_lower_bound(costs, 2, 3) <= best + 1e-12
    assert slot_lower_bound(np.array([10.0, 1, 1, 1]), 2, 2) == 11.0


@pytest.mark.parametrize("seed", range(4))
def test_rank_bounds_hold_for_the_order_and_for_every_order(seed):
    rng = np.random.default_rng(seed)
    P, M = 3, 5
    fwd, bwd = rng.lognormal(0, 0.7, (P, M)), rng.lognormal(0.5, 0.7, (P, M))
    makespans = []
    for perm in itertools.permutations(range(M)):
        f, b = fwd[:, perm], bwd[:, perm]
        makespan = simulate_1f1b(f, b, 0.05).makespan
        assert rank_lower_bound(f, b, 0.05, fixed_order=True) <= makespan + 1e-9
        makespans.append(makespan)
    assert rank_lower_bound(fwd, bwd, 0.05, fixed_order=False) <= min(makespans) + 1e-9


@pytest.mark.parametrize("seed", range(3))
def test_batch_bound_holds_for_every_algorithm(seed):
    rng = np.random.default_rng(seed)
    D, M, S = 2, 4, 2
    model = StageModel(stage_map=("enc", "bb/2", "bb/2", "gen"), p2p_latency=0.01)
    seq = rng.lognormal(0, 0.8, (D * M * S, 3))
    bound = batch_lower_bound(seq, model, D=D, M=M, S=S)
    totals = seq.sum(axis=1)
    for intra in reorder.INTRA_ALGORITHMS:
        plan = reorder.plan_batch(totals, D=D, M=M, S=S, intra=intra, inter="paper", rng=rng)
        per_rank = [seq[plan[r]].sum(axis=1) for r in range(D)]
        assert bound <= iteration_time(per_rank, model) + 1e-9
        assert rank_makespan(per_rank[0], model) > 0


@pytest.mark.parametrize("P,M", [(1, 3), (2, 1), (4, 8), (8, 32), (5, 3)])
def test_vectorised_makespans_equal_the_exact_event_simulator(P, M):
    rng = np.random.default_rng(P * 100 + M)
    fwd, bwd = rng.lognormal(0, 1, (6, P, M)), rng.lognormal(0.5, 1, (6, P, M))
    fast = makespans(fwd, bwd, 0.03)
    exact = [simulate_1f1b(fwd[r], bwd[r], 0.03).makespan for r in range(6)]
    np.testing.assert_allclose(fast, exact, rtol=1e-12)


def _generator_heavy(rng, B):
    """Per-sequence module times where most sequences have nothing to generate and a few a lot:
    the case where 1F1B's coupling of the last stage, not any stage's total, sets the makespan."""
    return np.column_stack([rng.lognormal(-3, 1, B), rng.uniform(0.9, 1.1, B),
                            rng.choice([0.0, 0.3, 2.0], B, p=[0.6, 0.25, 0.15])])


@pytest.mark.parametrize("seed", range(6))
def test_screening_bound_holds_for_fixed_orders_and_equals_the_rank_bound(seed):
    rng = np.random.default_rng(seed)
    R, P, M = 40, 1 + seed, 2 + 3 * seed
    fwd = rng.lognormal(0, 1, (R, P, M)) * (rng.random((R, P, M)) < 0.7)
    bwd = 2 * fwd
    bounds = pipeline_lower_bounds(fwd, bwd, 0.01)
    assert np.all(bounds <= makespans(fwd, bwd, 0.01) + 1e-9)
    assert bounds[3] == pytest.approx(rank_lower_bound(fwd[3], bwd[3], 0.01))


@pytest.mark.parametrize("S,stage_map", [(1, ("bb/2", "bb/2", "gen")), (2, ("enc", "bb", "gen"))])
def test_batch_bound_is_below_the_optimum_over_every_plan(S, stage_map):
    """Every assignment and order of a tiny batch (S=1), or 20000 random ones (S=2), run through the
    exact simulator."""
    rng = np.random.default_rng(S)
    D, M = 2, 3
    B = D * M * S
    model = StageModel(stage_map=stage_map, p2p_latency=0.001)
    seq = _generator_heavy(rng, B)
    fwd, bwd = model.stage_times(seq)
    if S == 1:
        plans = np.array(list(itertools.permutations(range(B))))
    else:
        plans = np.array([rng.permutation(B) for _ in range(20000)])
    plans = plans.reshape(len(plans) * D, M, S)
    spans = makespans(fwd[:, plans].sum(-1).transpose(1, 0, 2), bwd[:, plans].sum(-1).transpose(1, 0, 2),
                      model.p2p_latency).reshape(-1, D).max(axis=1)
    assert batch_lower_bound(seq, model, D=D, M=M, S=S) <= spans.min() + 1e-9


def test_coupling_bound_sees_the_stall_a_stage_load_bound_misses():
    """One generator-heavy microbatch on a backbone-bound rank: the generator's time cannot hide
    behind backbone work, because the backbone stage before it may hold only two microbatches."""
    model = StageModel(stage_map=("bb/2", "bb/2", "gen"), bwd_factor=(2.0, 2.0, 2.0))
    mb = np.array([[0.0, 1.0, 0.0]] * 8)
    mb[4, 2] = 3.0
    fwd, bwd = model.stage_times(mb)
    exact = simulate_1f1b(fwd, bwd).makespan
    work = (fwd + bwd).sum(axis=1).max()
    bound = rank_lower_bound(fwd, bwd)
    assert work < 0.7 * exact  # the busiest stage alone explains little of it
    assert 0.97 * exact <= bound <= exact + 1e-9
    seq = np.repeat(mb, 1, axis=0)
    assert batch_lower_bound(seq, model, D=1, M=8, S=1) >= 0.9 * exact


def test_a_fully_shared_single_stage_runs_everything_in_series():
    rng = np.random.default_rng(0)
    fwd, bwd = rng.uniform(0.5, 1, (3, 1, 4)), rng.uniform(0.5, 2, (3, 1, 4))
    t = simulate_coupled(fwd, bwd, [3])
    assert t.makespan == pytest.approx(fwd.sum() + bwd.sum())
    np.testing.assert_allclose(t.f_end[0], t.f_end[2])  # one op for all three ranks


@pytest.mark.parametrize("seed", range(8))
def test_coupled_simulation_matches_the_compiled_kernel_and_couples_ranks(seed):
    """The event-driven reference against the compiled component kernel, on random group layouts;
    with nothing shared it is the per-rank simulator, and sharing only ever delays a rank."""
    rng = np.random.default_rng(seed)
    L, P, M = [(2, 3, 5), (4, 4, 6), (6, 3, 4), (4, 5, 9)][seed % 4]
    fwd, bwd = rng.lognormal(0, 1, (L, P, M)), rng.lognormal(0.5, 1, (L, P, M))
    groups = [int(rng.choice([g for g in (1, 2, L) if L % g == 0])) for _ in range(P)]
    groups[0] = L  # at least one shared stage
    model = StageModel(stage_map=("enc",) + ("bb",) * (P - 2) + ("gen",), shared_by=(L, 1, groups[-1]),
                       p2p_latency=0.02)
    groups = list(model.stage_groups())
    coupled = simulate_coupled(fwd, bwd, groups, 0.02)
    assert component_makespans(fwd, bwd, model)[0] == pytest.approx(coupled.makespan, rel=1e-12)
    alone = [simulate_1f1b(fwd[r], bwd[r], 0.02) for r in range(L)]
    independent = simulate_coupled(fwd, bwd, [1] * P, 0.02)
    np.testing.assert_allclose(independent.b_end, np.stack([t.b_end for t in alone]))
    assert coupled.makespan >= max(t.makespan for t in alone) - 1e-12
    # a shared stage's op waits for all its ranks' inputs and lasts their sum
    np.testing.assert_allclose(coupled.f_end[:, 0] - coupled.f_start[:, 0], np.broadcast_to(fwd[:, 0].sum(0), (L, M)))


def test_coupling_makes_the_slot_matter():
    """Two ranks share one encoder replica. With independent ranks only each rank's own order
    matters; coupled, a slot where both ranks bring a heavy encoder microbatch stalls both."""
    model = StageModel(stage_map=("enc", "bb"), bwd_factor=(0.0, 1.0, 1.0), shared_by=(2, 1, 1))
    heavy, light = [4.0, 1.0, 0.0], [0.0, 1.0, 0.0]
    same_slot = [np.array([heavy, light, light, light]), np.array([heavy, light, light, light])]
    staggered = [np.array([heavy, light, light, light]), np.array([light, light, light, heavy])]
    independent = StageModel(stage_map=("enc", "bb"), bwd_factor=(0.0, 1.0, 1.0))
    assert iteration_time(same_slot, independent) == iteration_time(staggered, independent)
    assert iteration_time(same_slot, model) > iteration_time(staggered, model)


def test_shared_modules_are_validated():
    with pytest.raises(ValueError, match="backbone is never shared"):
        StageModel(stage_map=("bb",), shared_by=(1, 2, 1))
    model = StageModel(stage_map=("enc", "bb", "gen"), shared_by=(2, 1, 3))
    assert model.component == 6 and list(model.stage_groups()) == [2, 1, 3]
    with pytest.raises(ValueError, match="4 DP ranks do not split into groups of 6"):
        model.check_ranks(4)


@pytest.mark.parametrize("shared_by", [(2, 1, 1), (1, 1, 2), (4, 1, 2)])
def test_batch_bound_holds_for_coupled_plans(shared_by):
    rng = np.random.default_rng(sum(shared_by))
    D, M, S = 4, 3, 2
    model = StageModel(stage_map=("enc", "bb", "gen"), shared_by=shared_by, p2p_latency=0.001)
    seq = _generator_heavy(rng, D * M * S)
    seq[:, 0] = rng.lognormal(-0.5, 1, D * M * S)
    fwd, bwd = model.stage_times(seq)
    plans = np.array([rng.permutation(D * M * S).reshape(D, M, S) for _ in range(3000)])
    spans = [component_makespans(fwd[:, p].sum(-1).transpose(1, 0, 2), bwd[:, p].sum(-1).transpose(1, 0, 2),
                                 model).max() for p in plans]
    bound = batch_lower_bound(seq, model, D=D, M=M, S=S)
    assert bound <= min(spans) + 1e-9
    # the shared stage's term is the one that binds here: above every per-rank term
    independent = StageModel(stage_map=model.stage_map, p2p_latency=model.p2p_latency)
    assert bound > batch_lower_bound(seq, independent, D=D, M=M, S=S) or shared_by == (1, 1, 2)


@pytest.mark.parametrize("groups", [(1, 1, 1, 1), (1, -2, 1, -3), (-2, 1, 1, 1)])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_flat_kernel_equals_the_component_kernel(groups, M):
    """The planner's search simulates independent ranks with simkernels.simulate_flat: it must
    give exactly what component_spans (checked against the reference simulator) gives."""
    from preprocess_service.core import simkernels
    from preprocess_service.core.simulate import topological_order

    rng = np.random.default_rng(M)
    P, D = len(groups), 3
    F, B = rng.random((D, P, M)), rng.random((D, P, M))
    order = topological_order(P, M)
    g = np.array(groups, dtype=np.int64)
    want = simkernels.component_spans(F, B, 1, g, *order, 1e-3)
    src, dep, lat, prev = simkernels.flat_schedule(g, *order, P, M, 1e-3)
    end = np.empty(len(order[0]))
    got = [simkernels.simulate_flat(F.reshape(-1), B.reshape(-1), r * P * M, order[0], src, dep, lat, prev, end)
           for r in range(D)]
    assert np.array_equal(got, want)
