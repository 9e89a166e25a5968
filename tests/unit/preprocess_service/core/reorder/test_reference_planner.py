"""bench/reference_planner.py and reference_search.py, the planner's independent reference: its
simulator agrees with the service's, its exact optima are optimal, its search returns valid plans;
and bench/reorder.py --quick prints and writes the comparison."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest

from disttrain_api.layout import StageModel
from helpers import REPO
from preprocess_service.core.reorder.instance import PLANNERS, Instance, evaluate

BENCH = REPO / "bench"


def _load(name: str):
    """bench/NAME.py as module NAME (numba's on-disk cache names the module its kernels belong to)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and numba look their module up
    spec.loader.exec_module(module)
    return module


ref = _load("reference_planner")
search = _load("reference_search")

STAGE_MAPS = [("enc", "bb/2", "bb/2", "gen"), ("enc", *["bb/6"] * 6, "gen"), ("enc+bb/2", "bb/2+gen"), ("bb",),
              ("enc", "bb", "gen")]


def _instance(D, M, S, stage_map, seed, latency=1e-3):
    rng = np.random.default_rng(seed)
    B = D * M * S
    costs = np.column_stack([rng.lognormal(-2, 1, B), rng.uniform(0.05, 0.2, B),
                             rng.choice([0.0, 0.3], B, p=[0.7, 0.3])])
    model = StageModel(stage_map=stage_map, bwd_factor=(0.5, 2.0, 1.5), p2p_latency=latency)
    return Instance(D=D, M=M, S=S, model=model, costs=costs)


def test_reference_simulator_agrees_with_evaluate_on_random_plans():
    rng = np.random.default_rng(7)
    for trial in range(60):
        D, M, S = int(rng.integers(1, 5)), int(rng.integers(1, 12)), int(rng.integers(1, 4))
        inst = _instance(D, M, S, STAGE_MAPS[trial % len(STAGE_MAPS)], trial, latency=[0.0, 1e-3][trial % 2])
        r = ref.load_instance(json.loads(json.dumps(inst.to_json())))
        plan = rng.permutation(D * M * S).reshape(D, M, S)
        expected = evaluate(inst, plan)["iteration_s"]
        assert ref.iteration_time(r, plan) == pytest.approx(expected, rel=1e-9, abs=0)
        F, B = ref.plan_times(r, plan)
        replayed = ref.replay_many(F, B, r.latency, ref.schedule(r.P, M)).max()
        assert replayed == pytest.approx(expected, rel=1e-9, abs=0)


def test_reference_simulator_follows_the_1f1b_definition_on_a_hand_computed_case():
    # P=2, M=2, unit forwards, backwards of 2, no latency: stage 1 runs F0 B0 F1 B1, stage 0 F0 F1 B0 B1.
    # F0@0-1 (s0), F1@1-2 (s0), F0@1-2 (s1), B0@2-4 (s1), F1@4-5 (s1), B1@5-7 (s1), B0@4-6 (s0), B1@7-9 (s0)
    assert ref.simulate_rank(np.ones((2, 2)), np.full((2, 2), 2.0), 0.0) == 9.0


def test_the_reference_refuses_shared_replicas():
    inst = Instance(D=2, M=2, S=1, model=StageModel(stage_map=("enc", "bb"), shared_by=(2, 1, 1)),
                    costs=np.ones((4, 3)))
    with pytest.raises(ValueError, match="independent ranks only"):
        ref.load_instance(inst.to_json())


@pytest.mark.parametrize("D,M,S,stage_map", [(2, 2, 1, STAGE_MAPS[0]), (2, 2, 2, STAGE_MAPS[1]),
                                             (3, 2, 1, STAGE_MAPS[2]), (2, 3, 1, STAGE_MAPS[0])])
def test_exact_optimum_equals_brute_force_on_the_tiniest(D, M, S, stage_map):
    for seed in range(2):
        r = ref.load_instance(_instance(D, M, S, stage_map, seed).to_json())
        optimum, plan = ref.exact_optimum(r)
        assert ref.iteration_time(r, plan) == pytest.approx(optimum, rel=1e-12)
        assert optimum == pytest.approx(ref.brute_force(r), rel=1e-12)


@pytest.mark.parametrize("D,M,S,stage_map", [(2, 3, 2, STAGE_MAPS[0]), (3, 4, 1, STAGE_MAPS[1]),
                                             (3, 2, 2, STAGE_MAPS[4])])
def test_exact_optimum_is_no_slower_than_any_planner(D, M, S, stage_map):
    inst = _instance(D, M, S, stage_map, 3)
    optimum, _ = ref.exact_optimum(ref.load_instance(inst.to_json()))
    for name in ("arrival", "random", "paper", "lpt", "ours"):
        planned = evaluate(inst, PLANNERS[name](inst, np.random.default_rng(0)))["iteration_s"]
        assert optimum <= planned * (1 + 1e-9), name


def test_independent_search_returns_a_valid_plan_no_slower_than_its_start():
    inst = _instance(4, 6, 2, STAGE_MAPS[0], 5)
    r = ref.load_instance(inst.to_json())
    start = ref.iteration_time(r, search.vector_lpt_plan(r))
    found, plan = search.search(r, 0.3, seed=1)
    assert plan.shape == (4, 6, 2) and sorted(plan.ravel().tolist()) == list(range(48))
    assert found == pytest.approx(evaluate(inst, plan)["iteration_s"], rel=1e-9)
    assert found <= start


def test_quick_bench_prints_gaps_to_the_optimum_and_to_the_independent_search(tmp_path, capsys):
    bench = _load("reorder")
    out = tmp_path / "reorder.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "gap to the exact optimum" in text and "independent 0.5-second search" in text
    doc = json.loads(out.read_text())
    assert doc["bench"] == "reorder" and doc["quick"] is True and len(doc["tables"]) == 2
    exact, searched = doc["tables"]
    ours = exact["columns"].index("ours")
    assert len(exact["rows"]) == len(bench.QUICK_EXACT) and all(row[ours] >= 0 for row in exact["rows"])
    assert len(searched["rows"]) == len(bench.QUICK_DIMS)
    assert len(doc["instances"]) == len(bench.QUICK_DIMS)
