"""bench/paper.py, the paper-scale SIMULATION: its data and pricing agree with the service's own
packer, cost model and image policy, and its ladder has the structure it claims (quick mode)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys

import numpy as np
import pytest

from disttrain_api.config import ImageConfig
from helpers import REPO
from preprocess_service.core.packing import PackedSequence, Packer, price
from preprocess_service.core.reorder.instance import PLANNERS, evaluate

pytestmark = pytest.mark.unit


def _load_paper():
    path = REPO / "bench" / "paper.py"
    spec = importlib.util.spec_from_file_location("bench_paper", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_paper"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


paper = _load_paper()
BACKBONES = ("7B", "13B", "72B")


@pytest.fixture(scope="module")
def batches():
    return paper.make_batches(paper.DataSpec(), 1, 1152)


@pytest.fixture(scope="module")
def ladders(batches):
    return {b: paper.run_ladder(paper.Scenario(backbone=b, global_batch=1152), batches) for b in BACKBONES}


def test_the_packing_rule_is_the_service_packers():
    spec = paper.DataSpec(seq_len=2048)
    docs = paper.sample_documents(np.random.default_rng(3), 400, spec)
    packer, expected = Packer(2048, 4), []
    for doc in docs:
        expected += [[d.key for d in seq.documents] for seq in packer.add(doc)]
    got = [[d.key for d in seq] for seq in paper.pack(docs, 2048, 4)]
    assert got == expected and len(got) > 20


def test_sequences_are_priced_by_the_service_cost_model():
    spec = paper.DataSpec()
    docs = paper.sample_documents(np.random.default_rng(4), 2000, spec)
    sequences = paper.pack(docs, spec.seq_len, 8)
    enc, bb, gen, _ = paper.Scenario(backbone="13B").modules()
    config = paper.cost_config(enc, bb, gen, (2, 4, 1))
    seconds = paper.module_seconds(np.array([paper.sequence_features(s) for s in sequences]), config)
    for row, docs_of_seq in zip(seconds, sequences):
        cost = price(PackedSequence(seq_len=spec.seq_len, documents=docs_of_seq), config)
        assert row == pytest.approx([cost.encoder_s, cost.backbone_s, cost.generator_s], rel=1e-9)


def test_image_tokens_follow_the_service_resize_rule():
    imaging = pytest.importorskip("preprocess_service.adapters.media.imaging")
    rng = np.random.default_rng(5)
    short, aspect = rng.integers(10, 5000, 500).astype(float), np.exp(np.abs(rng.normal(0, 0.6, 500)))
    landscape = rng.random(500) < 0.5
    for cap in (256, 1024):
        spec = paper.DataSpec(max_image_tokens=cap)
        config = ImageConfig(max_pixels=cap * 28 * 28)
        got = paper._image_tokens(short, aspect, landscape, spec)
        for i in range(500):
            h, w = (short[i], short[i] * aspect[i]) if landscape[i] else (short[i] * aspect[i], short[i])
            assert got[i] == imaging.num_image_tokens(*imaging.target_size(w, h, config), config)
        assert got.max() <= cap


def test_data_is_seeded_and_heterogeneous_unless_asked_not_to_be(batches):
    assert np.array_equal(paper.make_batches(paper.DataSpec(), 1, 64)[0], batches[0][:64])
    assert batches[0][:, paper.ENC_T].std() > 0.1 * batches[0][:, paper.ENC_T].mean()
    flat = paper.make_batches(paper.DataSpec(homogeneous=True), 1, 64)[0]
    assert np.ptp(flat, axis=0).max() == 0


def test_the_ladder_has_every_rung_in_order_within_the_gpu_budget(ladders):
    for ladder in ladders.values():
        assert [r["rung"] for r in ladder.rows] == [r.key for r in paper.RUNGS]
        assert ladder.rows[0]["x_megatron"] == 1.0
        assert math.prod(r["x_previous"] for r in ladder.rows) == pytest.approx(ladder.rows[-1]["x_megatron"])
        for kind, plan in ladder.plans.items():
            assert plan.kind == kind and 0 < plan.gpus <= ladder.scenario.gpus
            plan.layout().stage_model().check_ranks(plan.bb.dp)
        # the checked layout is the planner's own pick unless the exact simulator finds a faster one
        assert not ladder.mean_s["planner"] < ladder.mean_s["disaggregated"]  # nan: the pick cannot run
        assert all(0 < r["mfu"] < 1 and r["iteration_s"] > 0 for r in ladder.rows)


def test_ours_is_never_slower_than_the_plan_it_starts_from(ladders, batches):
    # plan_ours starts from the faster of its vector plan and lpt + paper, and keeps only improvements
    for backbone, ladder in ladders.items():
        scenario = ladder.scenario
        problem = paper.problem_for(scenario, paper.mean_content(batches[0], 1))
        layout = paper.simulable(ladder.plans["disaggregated"], problem, scenario, batches[0].mean(axis=0))
        costs = layout.seconds(batches[0])
        instance = layout.instance(costs)
        ours = layout.iteration_s(costs, PLANNERS["ours"](instance, np.random.default_rng(0)))
        lpt = layout.iteration_s(costs, PLANNERS["lpt"](instance, np.random.default_rng(0)))
        assert ours <= lpt + 1e-9, backbone


def test_the_simulated_iteration_is_the_services_evaluate_plus_gradient_sync(ladders, batches):
    ladder = ladders["13B"]
    problem = paper.problem_for(ladder.scenario, paper.mean_content(batches[0], 1))
    for plan in ladder.plans.values():
        layout = paper.simulable(plan, problem, ladder.scenario, batches[0].mean(axis=0))
        costs = layout.seconds(batches[0])
        instance = layout.instance(costs)
        assignment = PLANNERS["paper"](instance, np.random.default_rng(0))
        expected = evaluate(instance, assignment)["iteration_s"] + layout.sync_s
        assert layout.iteration_s(costs, assignment) == pytest.approx(expected, rel=1e-12)


def test_without_heterogeneity_reordering_changes_nothing():
    flat = paper.make_batches(paper.DataSpec(homogeneous=True), 1, 1152)
    ladder = paper.run_ladder(paper.Scenario(backbone="7B", global_batch=1152), flat, compare_pick=False)
    base = ladder.row("disagg")["iteration_s"]
    for key in ("intra", "inter", "ours"):
        assert ladder.row(key)["iteration_s"] / base == pytest.approx(1.0, abs=1e-9)


def test_a_balanced_split_never_slows_the_mean_sequences_slowest_stage():
    mean_fwd = np.array([0.3, 1.0, 0.05])
    for layers, pp in ((32, 4), (40, 8), (80, 16)):
        counts = paper.balanced_layers(layers, pp, mean_fwd)
        even = [layers // pp] * pp
        slowest = [max(c / layers * mean_fwd[1] + (mean_fwd[0] if s == 0 else 0) + (mean_fwd[2] if s == pp - 1 else 0)
                       for s, c in enumerate(split)) for split in (counts, even)]
        assert sum(counts) == layers and min(counts) >= 0 and slowest[0] <= slowest[1]
        assert counts[0] < even[0]


def test_a_sweep_axis_reports_how_far_it_moves_the_ratio(batches):
    axes = (("gradient sync exposed", (("all", {}, {}), ("none", {"sync": 0.0}, {}))),)
    records = paper.run_sweep(paper.Scenario(global_batch=1152), 1, ("7B",), axes=axes)
    assert [(r["axis"], r["value"]) for r in records] == [("gradient sync exposed", "all"),
                                                          ("gradient sync exposed", "none")]
    (axis, spread, reached), = paper.decisive(records)
    assert axis == "gradient sync exposed" and spread == pytest.approx(abs(records[0]["best"] - records[1]["best"]))
    assert reached == max(r["best"] for r in records)


def test_quick_mode_prints_a_labelled_simulation_and_writes_plot_and_json(tmp_path, capsys):
    # the fixture's layouts at S=1 are cached; S=2 searches its own
    png, dump = tmp_path / "ladder.png", tmp_path / "ladder.json"
    argv = ["--quick", "--backbones", "7B,13B", "--seqs-per-microbatch", "1,2", "--plot", str(png), "--json", str(dump)]
    assert paper.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("SIMULATION")
    positions = [out.index(rung.label) for rung in paper.RUNGS]
    assert positions == sorted(positions) and out.count(paper.RUNGS[-1].label) == 4  # 2 backbones x 2 S
    assert out.count("S=1 sequences per microbatch") == 2 and out.count("S=2 sequences per microbatch") == 2
    assert "2.2x" in out and "54.7% MFU" in out
    assert png.stat().st_size > 10_000
    data = json.loads(dump.read_text())
    benchjson = sys.modules["benchjson"]  # the bench imported it from its own folder
    assert benchjson.check(data)["bench"] == "paper" and data["quick"] is True
    assert data["command"].endswith("bench/paper.py " + " ".join(argv))
    assert len(data["ladders"]) == 4 and data["sweep"] is None
    assert {dataclasses.fields(paper.Scenario)[0].name} <= set(data["ladders"][0]["scenario"])
    ladder_table, planners_table = data["tables"]
    assert [row[:3] for row in planners_table["rows"]] == [["A800", "7B", 1], ["A800", "13B", 1],
                                                           ["A800", "7B", 2], ["A800", "13B", 2]]
    assert planners_table["columns"][3:] == [r.key for r in paper.COMPARED[1:]] + ["ours/paper"]
    assert [row[:3] for row in ladder_table["rows"]] == [row[:3] for row in planners_table["rows"]]


def test_every_planner_is_compared_on_the_ladders_layout(ladders):
    for ladder in ladders.values():
        compared = {r["rung"]: r for r in ladder.compared}
        assert list(compared) == [r.key for r in paper.COMPARED] and compared["arrival"]["x_arrival"] == 1.0
        # the same planner on the same layout and batches as a rung: the same figure
        for rung, key in (("disagg", "arrival"), ("intra", "paper-intra"), ("inter", "paper"), ("ours", "ours")):
            assert compared[key]["iteration_s"] == ladder.row(rung)["iteration_s"]
        assert compared["ours"]["iteration_s"] <= compared["paper"]["iteration_s"] * (1 + 1e-9)


def test_a_scenario_no_layout_fits_is_named(batches):
    with pytest.raises(paper.NoLayout, match="no disaggregated layout of 72B fits 8 GPUs"):
        paper.run_ladder(paper.Scenario(backbone="72B", gpus=8, global_batch=1152), batches, compare_pick=False)


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_cost_coefficients_reproduce_the_flop_profiles_seconds(tp):
    from trainer.orchestration.profile import Content

    enc, bb, gen, _ = paper.Scenario(backbone="13B").modules()
    cases = ((bb, Content(tokens=8000, image_tokens=0, gen_images=0, doc_len=1000), 8000, 8000 * 1000),
             (enc, Content(tokens=0, image_tokens=3000, gen_images=0, image_len=600.0), 3000, 3000 * 600),
             (gen, Content(tokens=0, image_tokens=0, gen_images=3), 3, 0))
    for profile, content, work, attention in cases:
        linear, quadratic = profile.cost_coefficients(tp)
        assert profile.fwd_s(content, tp) == pytest.approx(linear * work + quadratic * attention, rel=1e-12)


def test_gradient_sync_is_what_the_planner_adds_to_its_estimate(ladders, batches):
    for ladder in ladders.values():
        problem = paper.problem_for(ladder.scenario, paper.mean_content(batches[0], 1))
        for plan in ladder.plans.values():
            again = (paper.monolithic(problem, plan.bb) if plan.kind == "monolithic"
                     else paper.disaggregated(problem, plan.enc, plan.bb, plan.gen))
            assert again is not None and again.iteration_s == pytest.approx(plan.iteration_s, rel=1e-12)
            stages, M = again.stage_s, again.num_microbatches
            pipeline = sum(stages) + (M - 1) * max(stages) + 2 * (len(stages) - 1) * problem.p2p_s
            assert again.iteration_s == pytest.approx(pipeline + paper.grad_sync_s(problem, again), rel=1e-12)
