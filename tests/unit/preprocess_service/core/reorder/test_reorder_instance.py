import json
import subprocess
import sys

import numpy as np
import pytest

from disttrain_api.config import JobConfig, field_defaults
from disttrain_api.layout import StageModel
from helpers import REPO
from preprocess_service.core.reorder.instance import PLANNERS, Instance, check_plan, evaluate, plan_instance


def _instance(D=4, M=6, S=2, seed=0, shared_by=(1, 1, 1)):
    rng = np.random.default_rng(seed)
    costs = np.column_stack([rng.lognormal(-1, 1, D * M * S), rng.uniform(0.5, 1.0, D * M * S),
                             rng.choice([0.0, 0.8], D * M * S, p=[0.7, 0.3])])
    model = StageModel(stage_map=("enc", "bb/2", "bb/2", "gen"), bwd_factor=(0.0, 2.0, 1.0), p2p_latency=0.001,
                       shared_by=shared_by)
    return Instance(D=D, M=M, S=S, model=model, costs=costs)


def test_instance_json_round_trip():
    for inst in (_instance(), _instance(shared_by=(2, 1, 4))):
        again = Instance.from_json(json.loads(json.dumps(inst.to_json())))
        assert again.model == inst.model and np.array_equal(again.costs, inst.costs)
        assert inst.to_json()["format"] == "disttrain-reorder-instance/1"
    data = _instance().to_json()
    del data["shared_by"]  # optional: independent ranks
    assert Instance.from_json(data).model.shared_by == (1, 1, 1)
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        Instance.from_json(data | {"shared_by": {"enc": 3}})
    with pytest.raises(ValueError, match="shared_by must map"):
        Instance.from_json(data | {"shared_by": {"bb": 2}})


@pytest.mark.parametrize("name", sorted(PLANNERS))
def test_every_planner_gives_a_valid_plan_no_faster_than_the_bound(name):
    inst = _instance()
    result = plan_instance(inst, name)
    assert result["format"] == "disttrain-reorder-plan/1" and result["meta"]["method"] == name
    figures = evaluate(inst, np.array(result["plan"]))
    assert figures["ratio_to_bound"] >= 1.0 - 1e-9


def test_bad_plans_are_named():
    inst = _instance(D=2, M=2, S=1)
    with pytest.raises(ValueError, match="shape"):
        check_plan(inst, np.zeros((2, 2)))
    with pytest.raises(ValueError, match=r"missing \[3\], repeated \[0\]"):
        check_plan(inst, np.array([[[0], [1]], [[2], [0]]]))
    bad = inst.to_json() | {"P": 3}
    with pytest.raises(ValueError, match="stage_map has 4"):
        Instance.from_json(bad)


def test_cli_plans_and_evaluates(tmp_path):
    path = tmp_path / "inst.json"
    path.write_text(json.dumps(_instance().to_json()))
    out = tmp_path / "plan.json"
    run = subprocess.run([sys.executable, "-m", "disttrain_tools", "reorder", "plan", str(path), "--algorithm",
                          "paper", "-o", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    figures = json.loads(run.stdout)
    assert figures["planning_s"] >= 0 and figures["jit_s"] >= 0  # planning time reported apart from the JIT
    plan = json.loads(out.read_text())
    assert sorted(np.array(plan["plan"]).ravel().tolist()) == list(range(48))
    judged = subprocess.run([sys.executable, "-m", "disttrain_tools", "reorder", "evaluate", str(path), str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert judged.returncode == 0 and json.loads(judged.stdout)["ratio_to_bound"] >= 1.0
    unknown = subprocess.run([sys.executable, "-m", "disttrain_tools", "reorder", "plan", str(path), "--algorithm",
                              "magic", "-o", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2 and "unknown algorithm 'magic'" in unknown.stderr


@pytest.mark.parametrize("D,M,S", [(1, 1, 1), (1, 5, 2), (3, 1, 1), (2, 2, 3)])
def test_every_planner_handles_degenerate_shapes(D, M, S):
    inst = _instance(D=D, M=M, S=S)
    for name in PLANNERS:
        check_plan(inst, np.array(plan_instance(inst, name)["plan"]))


def test_ours_is_deterministic_and_never_worse_than_lpt_or_paper():
    for seed in range(3):
        inst = _instance(D=4, M=6, S=2, seed=seed)
        ours = plan_instance(inst, "ours", seed)["plan"]
        assert ours == plan_instance(inst, "ours", seed)["plan"]
        ours_s = evaluate(inst, np.array(ours))["iteration_s"]
        for baseline in ("lpt", "paper"):
            baseline_plan = np.array(plan_instance(inst, baseline, seed)["plan"])
            assert ours_s <= evaluate(inst, baseline_plan)["iteration_s"] + 1e-12


@pytest.mark.parametrize("shared_by", [(2, 1, 1), (4, 1, 2)])
def test_ours_plans_for_coupled_ranks(shared_by):
    """Shared encoder/generator replicas: ours is valid, deterministic, never worse than lpt or
    paper, and better under the coupled objective than the plan it makes for independent ranks."""
    for seed in range(3):
        coupled = _instance(D=4, M=6, S=2, seed=seed, shared_by=shared_by)
        independent = _instance(D=4, M=6, S=2, seed=seed)
        plan = np.array(plan_instance(coupled, "ours", seed)["plan"])
        assert plan.tolist() == plan_instance(coupled, "ours", seed)["plan"]
        mine = evaluate(coupled, plan)
        assert mine["ratio_to_bound"] >= 1.0 - 1e-9
        for baseline in ("lpt", "paper"):
            assert mine["iteration_s"] <= evaluate(coupled, np.array(plan_instance(coupled, baseline, seed)["plan"]))[
                "iteration_s"] + 1e-12
        unaware = np.array(plan_instance(independent, "ours", seed)["plan"])
        assert mine["iteration_s"] <= evaluate(coupled, unaware)["iteration_s"] + 1e-12


@pytest.mark.parametrize("D,M,S", [(8, 8, 1), (4, 6, 1), (8, 8, 2), (4, 6, 4)])
def test_paper_beats_no_reordering_and_random_at_every_microbatch_size(D, M, S):
    """The simulated iteration, averaged over 10 batches: the paper's planner balances the ranks at
    one sequence per microbatch too (its per-slot greedy once dealt rank 0 every slot's largest
    sequence there and trailed random)."""
    ratios = {name: [] for name in ("arrival", "random", "paper")}
    for seed in range(10):
        inst = _instance(D=D, M=M, S=S, seed=seed)
        for name, values in ratios.items():
            values.append(evaluate(inst, np.array(plan_instance(inst, name, seed)["plan"]))["ratio_to_bound"])
    mean = {name: float(np.mean(values)) for name, values in ratios.items()}
    assert mean["paper"] < min(mean["arrival"], mean["random"]) - 0.05, mean


DEFAULT = field_defaults(JobConfig)["reorder_algorithm"]


def _random_instance(seed):
    """A random shape, stage map, sharing and cost mix: what 'never worse than paper' must hold on."""
    rng = np.random.default_rng([seed, 0xBAD])
    D, M, S = (int(x) for x in rng.choice([1, 2, 4, 8], 3))
    stage_map = [("enc", "bb", "gen"), ("enc", "bb/2", "bb/2", "gen"), ("bb",), ("enc", *["bb/3"] * 3, "gen")][
        seed % 4]
    shared = [(1, 1, 1), (2, 1, 1), (1, 1, 2), (2, 1, 4)][int(rng.integers(4))] if D % 4 == 0 else (1, 1, 1)
    B = D * M * S
    costs = np.column_stack([rng.lognormal(-2, 1.2, B) * (rng.random(B) < 0.8), rng.uniform(0.2, 1.0, B),
                             rng.choice([0.0, 0.3, 1.5], B, p=[0.7, 0.2, 0.1])])
    model = StageModel(stage_map=stage_map, bwd_factor=tuple(rng.uniform(0.0, 2.5, 3)),
                       p2p_latency=float(rng.choice([0.0, 1e-3])), shared_by=shared)
    return Instance(D=D, M=M, S=S, model=model, costs=costs)


def test_the_default_planner_is_never_worse_than_paper_and_deterministic():
    for seed in range(40):
        inst = _random_instance(seed)
        mine = plan_instance(inst, DEFAULT, seed)["plan"]
        assert mine == plan_instance(inst, DEFAULT, seed)["plan"], "a plan is a function of instance and seed"
        paper = evaluate(inst, np.array(plan_instance(inst, "paper", seed)["plan"]))["iteration_s"]
        assert evaluate(inst, np.array(mine))["iteration_s"] <= paper * (1 + 1e-12), (seed, inst.D, inst.M, inst.S)


def test_warm_up_compiles_every_kernel_signature_planning_uses():
    """reorder.warm_up() at a service's start must leave nothing for a job's first step to compile:
    planning (independent, split and coupled ranks) and evaluating add no numba signature after it."""
    from preprocess_service.core import reorder, simkernels

    reorder.warm_up()
    kernels = [simkernels.local_search, simkernels.component_spans]
    before = [list(k.signatures) for k in kernels]
    assert all(before), "warm_up compiled (or loaded) the search and the simulator"
    for seed in range(8):
        inst = _random_instance(seed)
        evaluate(inst, np.array(plan_instance(inst, DEFAULT, seed)["plan"]))
    assert [list(k.signatures) for k in kernels] == before


def test_every_cli_and_bench_plans_with_the_service_default():
    import importlib.util

    from disttrain_tools import reorder_cli

    assert reorder_cli.build_parser().parse_args(["plan", "i.json", "-o", "o.json"]).algorithm == DEFAULT
    spec = importlib.util.spec_from_file_location("bench_reorder", REPO / "bench" / "reorder.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.DEFAULT == DEFAULT and DEFAULT in PLANNERS
