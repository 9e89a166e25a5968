"""One pipeline layout for the runtime, the service's simulator and the planner
(disttrain_api.layout): its definitions, and a real run whose per-rank work must have the
structure the simulator predicts."""

from __future__ import annotations

import numpy as np
import pytest

from disttrain_api.config import JobConfig
from disttrain_api.errors import ConfigError
from disttrain_api.layout import PipelineLayout, StageModel
from preprocess_service.core.simulate import component_makespans, simulate_1f1b, simulate_coupled


@pytest.mark.unit
@pytest.mark.parametrize("layout,stage_map,shared,split", [
    (PipelineLayout(0, 2, 1, 0), ("enc+bb+gen",), (1, 1, 1), (1, 1, 1)),
    (PipelineLayout(0, 1, 2, 0), ("enc+bb/2", "bb/2+gen"), (1, 1, 1), (1, 1, 1)),
    (PipelineLayout(1, 2, 2, 1), ("enc", "bb/2", "bb/2", "gen"), (2, 1, 2), (1, 1, 1)),
    (PipelineLayout(4, 2, 1, 1), ("enc", "bb", "gen"), (1, 1, 2), (2, 1, 1)),
    (PipelineLayout(0, 3, 3, 6), ("enc+bb/3", "bb/3", "bb/3", "gen"), (1, 1, 1), (1, 1, 2)),
])
def test_the_layout_derives_the_stage_model_the_service_plans_for(layout, stage_map, shared, split):
    model = layout.stage_model()
    assert model.stage_map == stage_map and model.shared_by == shared and model.split_by == split
    config = JobConfig(shards=("s",), dp_size=layout.bb_dp, stage_map=model.stage_map,
                       enc_shared_by=layout.enc_shared_by, gen_shared_by=layout.gen_shared_by,
                       enc_split_by=layout.enc_split_by, gen_split_by=layout.gen_split_by)
    assert config.stage_model() == model  # the service's model of the job is the layout's
    # every (chain, microbatch) runs exactly once, forward and backward, on every stage
    M = 5
    for stage in range(model.num_stages):
        ops = [op for replica in range(model.replicas(stage, layout.bb_dp))
               for op in model.stage_ops(stage, replica, M)]
        assert sorted(ops) == sorted((k, d, m) for k in "FB" for d in range(layout.bb_dp) for m in range(M))
    # the runtime's ranks run their stage replica's ops; a module inside a backbone stage runs in it
    for rank in range(layout.world_size):
        role = layout.role(rank)
        if role[0] == "bb":
            assert layout.ops(rank, M) == model.stage_ops(layout.chain_stage(role[2]), role[1], M)
    for d in range(layout.bb_dp):
        for m in range(M):
            if layout.enc_dp:
                assert (m in [x[2] for x in model.stage_ops(0, layout.enc_of(d, m), M) if x[1] == d])
            if layout.gen_dp:
                assert (m in [x[2] for x in model.stage_ops(model.num_stages - 1, layout.gen_of(d, m), M)
                              if x[1] == d])


@pytest.mark.unit
def test_layouts_that_no_replica_mapping_fits_are_refused():
    with pytest.raises(ValueError, match="must divide bb_dp 4 or be a multiple"):
        PipelineLayout(3, 4, 1, 1)
    with pytest.raises(ValueError, match="gen_tp must be 1"):
        PipelineLayout(1, 1, 1, 0, gen_tp=2)
    with pytest.raises(ValueError, match="both shared"):
        StageModel(stage_map=("enc", "bb"), shared_by=(2, 1, 1), split_by=(2, 1, 1))
    with pytest.raises(ValueError, match="one stage is one replica"):
        StageModel(stage_map=("enc+bb",), shared_by=(2, 1, 1))
    with pytest.raises(ConfigError, match="enc_split_by"):
        JobConfig(shards=("s",), enc_split_by=65)


@pytest.mark.unit
@pytest.mark.parametrize("seed", range(6))
def test_split_stages_in_the_reference_and_the_compiled_simulator(seed):
    """k replicas per rank: the reference and the kernel agree, one replica (k = 1) is never faster,
    and with all the time on the split stage k replicas finish sooner, at most k times."""
    rng = np.random.default_rng(seed)
    D, M, k = [(1, 6, 2), (2, 8, 2), (3, 9, 3), (2, 7, 4), (4, 6, 2), (1, 5, 3)][seed]
    P = 3
    fwd, bwd = rng.lognormal(0, 1, (D, P, M)), rng.lognormal(0.5, 1, (D, P, M))
    model = StageModel(stage_map=("enc", "bb", "gen"), split_by=(k, 1, 1), p2p_latency=0.01)
    ref = simulate_coupled(fwd, bwd, [1] * P, 0.01, model.stage_splits())
    assert component_makespans(fwd, bwd, model).max() == pytest.approx(ref.makespan, rel=1e-12)
    single = max(simulate_1f1b(fwd[r], bwd[r], 0.01).makespan for r in range(D))
    assert ref.makespan <= single + 1e-12
    # the encoder's replica j runs only microbatches m % k == j, one at a time
    for r in range(D):
        for j in range(k):
            spans = sorted((ref.f_start[r, 0, m], ref.f_end[r, 0, m]) for m in range(j, M, k))
            spans += sorted((ref.b_start[r, 0, m], ref.b_end[r, 0, m]) for m in range(j, M, k))
            spans.sort()
            assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))
    heavy = np.zeros((1, P, 12))
    heavy[0, 0] = 1.0
    split = StageModel(stage_map=("enc", "bb", "gen"), split_by=(k, 1, 1))
    one = StageModel(stage_map=("enc", "bb", "gen"))
    alone, turns = component_makespans(heavy, heavy, one)[0], component_makespans(heavy, heavy, split)[0]
    assert alone / k - 1e-9 <= turns < alone  # faster, at most k times (1F1B limits what is in flight)
