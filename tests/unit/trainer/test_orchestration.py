"""The orchestration planner: its iteration-time model, its search, and the paper-scale simulation."""

from __future__ import annotations

import itertools
import json

import pytest

from trainer.orchestration import simulate
from trainer.orchestration.planner import (
    TP_SIZES,
    Parallel,
    Problem,
    disaggregated,
    monolithic,
    search_disaggregated,
    search_exact,
    search_monolithic,
)
from trainer.orchestration.profile import Accelerator, Content, MeasuredProfile

ACC = Accelerator("test", peak_flops=1e12, efficiency=1.0, memory_bytes=1e12, tp_link_bytes_s=1e12,
                  dp_link_bytes_s=1e30, max_tp=4)
CONTENT = Content(tokens=1000, image_tokens=400, gen_images=1.0)


def _problem(num_gpus=16, enc=(0, 0, 1e-3, 0), bb=(1e-3, 0, 0, 0), gen=(0, 0, 0, 0.2), memory=1e12, layers=8,
             global_batch=32, max_tp=4) -> Problem:
    acc = Accelerator("test", peak_flops=1e12, efficiency=1.0, memory_bytes=memory, tp_link_bytes_s=1e12,
                      dp_link_bytes_s=1e30, max_tp=max_tp)
    return Problem(encoder=MeasuredProfile("enc", 1e6, enc, accelerator=acc),
                   backbone=MeasuredProfile("bb", 1e8, bb, accelerator=acc),
                   generator=MeasuredProfile("gen", 1e6, gen, accelerator=acc),
                   content=CONTENT, global_batch=global_batch, seqs_per_microbatch=1, num_gpus=num_gpus,
                   accelerator=acc, backbone_layers=layers)


def test_iteration_time_is_first_microbatch_plus_m_minus_one_slowest_stage():
    problem = _problem()
    plan = disaggregated(problem, Parallel(2, 1), Parallel(2, 1, 2), Parallel(1, 1))
    # forward seconds: enc 0.4, bb 1.0 (0.5 per stage), gen 0.2; backward = 2x; enc and gen serve 2 bb ranks
    enc, bb_stage, gen = 2 / 2 * 1.2, 1.5, 2 / 1 * 0.6
    assert plan.stage_s == pytest.approx([enc, bb_stage, bb_stage, gen])
    assert plan.num_microbatches == 16
    assert plan.iteration_s == pytest.approx(enc + 2 * bb_stage + gen + 15 * bb_stage)
    assert plan.gpus == 2 + 4 + 1


def test_monolithic_puts_the_encoder_in_the_first_stage_and_the_generator_in_the_last():
    plan = monolithic(_problem(), Parallel(2, 1, 4))
    assert plan.stage_s == pytest.approx([0.75 + 1.2, 0.75, 0.75, 0.75 + 0.6])
    assert plan.iteration_s == pytest.approx(sum(plan.stage_s) + 15 * (0.75 + 1.2))


def test_layouts_over_budget_or_memory_are_rejected():
    problem = _problem(num_gpus=6)
    assert disaggregated(problem, Parallel(2, 1), Parallel(2, 1, 2), Parallel(1, 1)) is None  # 7 GPUs
    assert monolithic(problem, Parallel(2, 2, 2)) is None
    tight = _problem(memory=5e8)  # weights, grads and Adam states of the backbone: 1.6e9 bytes on one GPU
    assert monolithic(tight, Parallel(1, 1, 1)) is None
    assert monolithic(tight, Parallel(1, 1, 4)) is not None  # 4e8 per stage, plus the small encoder


def test_search_finds_the_fastest_layout_of_a_brute_force_enumeration():
    problem = _problem(num_gpus=12)
    best = None
    for bb_tp, pp, dp in itertools.product(TP_SIZES, (1, 2, 4, 8), (1, 2, 4, 8, 16, 32)):
        for enc_tp, gen_tp, enc_dp, gen_dp in itertools.product(TP_SIZES, TP_SIZES, range(1, 12), range(1, 12)):
            plan = disaggregated(problem, Parallel(enc_dp, enc_tp), Parallel(dp, bb_tp, pp), Parallel(gen_dp, gen_tp))
            if plan and (best is None or plan.iteration_s < best.iteration_s - 1e-12):
                best = plan
    found = search_disaggregated(problem)
    assert found.iteration_s == pytest.approx(best.iteration_s)
    assert found.gpus <= 12


def test_disaggregation_wins_when_the_encoder_makes_the_first_stage_a_straggler():
    # no TP, and memory for a quarter of the backbone per GPU: the monolithic layout needs pipeline
    # stages, and the encoder (as heavy as half the backbone) makes its first stage the straggler
    problem = _problem(num_gpus=16, enc=(0, 0, 1.25e-3, 0), memory=2e8, layers=16, global_batch=64, max_tp=1)
    dis, mono = search_disaggregated(problem), search_monolithic(problem)
    assert mono.bb.pp > 1 and mono.gpus == dis.gpus == 16
    assert max(mono.stage_s) == mono.stage_s[0]
    assert dis.throughput > 1.3 * mono.throughput
    assert max(dis.stage_s) < max(mono.stage_s)


def test_partly_disaggregated_layouts_keep_one_module_inside_the_backbone():
    problem = _problem(num_gpus=8)
    # encoder apart, generator inside the last of 2 backbone stages (fwd: enc 0.4, bb 0.5 per stage, gen 0.2)
    plan = disaggregated(problem, Parallel(1, 1), Parallel(2, 1, 2), Parallel(0, 1))
    assert plan.stage_s == pytest.approx([2 * 1.2, 1.5, 1.5 + 0.6])
    assert plan.gpus == 5 and plan.layout().stage_map == ("enc", "bb/2", "bb/2+gen")
    assert "gen in bb stage 2" in plan.describe()
    plan = disaggregated(problem, Parallel(0, 1), Parallel(2, 1, 1), Parallel(2, 1))
    assert plan.stage_s == pytest.approx([3.0 + 1.2, 0.6]) and plan.layout().stage_map == ("enc+bb", "gen")
    assert disaggregated(problem, Parallel(0, 1), Parallel(2, 1, 1), Parallel(0, 1)) is None  # monolithic's


@pytest.mark.parametrize("num_gpus", [2, 3, 5])
def test_exact_search_is_the_fastest_layout_of_exactly_the_world_size(num_gpus):
    """search_exact against brute force over every monolithic grid and every (partly) disaggregated
    layout of exactly num_gpus processes (on 2 processes the partly disaggregated ones are the only
    disaggregated candidates)."""
    problem = _problem(num_gpus=num_gpus, enc=(0, 0, 2.5e-3, 0), gen=(0, 0, 0, 0.05), global_batch=8, max_tp=2)
    grids = list(itertools.product((1, 2), (1, 2, 4, 8), range(1, 9)))
    plans = [monolithic(problem, Parallel(dp, tp, pp)) for tp, pp, dp in grids]
    for bb_tp, pp, dp in grids:
        for enc_tp, gen_tp, enc_dp, gen_dp in itertools.product((1, 2), (1, 2), range(6), range(6)):
            plans.append(disaggregated(problem, Parallel(enc_dp, enc_tp if enc_dp else 1), Parallel(dp, bb_tp, pp),
                                       Parallel(gen_dp, gen_tp if gen_dp else 1)))
    exact = [p for p in plans if p and p.gpus == num_gpus]
    best = min(exact, key=lambda p: p.iteration_s)
    found = search_exact(problem)
    assert found.gpus == num_gpus and found.iteration_s == pytest.approx(best.iteration_s)
    for kind in ("monolithic", "disaggregated"):
        fastest = min((p for p in exact if p.kind == kind), key=lambda p: p.iteration_s, default=None)
        found = search_exact(problem, kind)
        assert (found is None) if fastest is None else found.iteration_s == pytest.approx(fastest.iteration_s)
    if num_gpus == 5:  # no grid of 5 ranks divides both the batch (8) and the layers (8)
        assert search_exact(problem, "monolithic") is None
    if num_gpus == 2:
        assert {(p.enc.dp, p.gen.dp) for p in exact if p.kind == "disaggregated"} == {(1, 0), (0, 1)}


def test_measured_costs_round_trip_through_a_file_and_bad_files_are_named(tmp_path):
    from trainer.orchestration.measure import Measured

    measured = Measured(1.5e-4, 2e-5, 9e-3, (2.5, 2.3, 1.0), Content(2000, 900, 0.4), 6)
    path = tmp_path / "costs.json"
    measured.save(path)
    assert Measured.load(path) == measured
    assert Measured.load(path).cost_config().enc_linear_s == 1.5e-4
    data = json.loads(path.read_text())
    for key, value in (("bb_s_per_token", -1.0), ("gen_s_per_image", "0.1"), ("microbatches", float("inf"))):
        path.write_text(json.dumps({**data, key: value}))
        with pytest.raises(ValueError, match=key):
            Measured.load(path)
    path.write_text(json.dumps({**data, "extra": 1}))
    with pytest.raises(ValueError, match="extra"):
        Measured.load(path)


def test_paper_scale_simulation_prints_both_layouts_labelled_as_simulation(capsys):
    assert simulate.main(["--gpus", "256", "--global-batch", "512"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SIMULATION")
    assert out.count("disaggregated / monolithic") == 3 and "MFU" in out
