"""Online refit of the cost model from measured stage times (JobSpec.cost_feedback)."""

from __future__ import annotations

import dataclasses

import grpc
import numpy as np
import pytest

from helpers import write_tiny_shards
from preprocess_service import synth
from preprocess_service.config import CostConfig, JobConfig
from preprocess_service.cost import price_sequence
from preprocess_service.feedback import CostRefitter, Observation, microbatch_features
from preprocess_service.job import Job
from preprocess_service.packing import price
from preprocess_service.server import create_server
from trainer import DataClient

TRUE = CostConfig(enc_linear_s=3e-5, enc_quadratic_s=4e-8, bb_linear_s=2e-5, bb_quadratic_s=5e-9,
                  gen_per_image_s=0.05)


def _measured(features, cost=TRUE):
    """What a trainer would measure (forward + backward) if the cost model with ``cost`` were exact."""
    (et, et2), (bn, bn2), (g,) = features
    return ((cost.enc_linear_s * et + cost.enc_quadratic_s * et2) * (1 + cost.enc_backward_factor),
            (cost.bb_linear_s * bn + cost.bb_quadratic_s * bn2) * (1 + cost.bb_backward_factor),
            cost.gen_per_image_s * g * (1 + cost.gen_backward_factor))


def test_refit_recovers_the_coefficients_that_produced_the_timings():
    rng = np.random.default_rng(0)
    refitter = CostRefitter(CostConfig(), min_observations=4)
    for _ in range(20):
        images = rng.integers(4, 1024, size=rng.integers(1, 6)).tolist()
        docs = rng.integers(50, 3000, size=rng.integers(1, 5)).tolist()
        features = ((float(sum(images)), float(sum(t * t for t in images))),
                    (float(sum(docs)), float(sum(n * n for n in docs))), (float(rng.integers(0, 3)),))
        refitter.add(Observation(features, _measured(features)))
    cost = refitter.refit()
    for name in ("enc_linear_s", "enc_quadratic_s", "bb_linear_s", "bb_quadratic_s", "gen_per_image_s"):
        assert getattr(cost, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert max(refitter.errors.values()) < 1e-6


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("feedback-shards")
    synth.main(["--out", str(root), "--num-shards", "1", "--samples-per-shard", "160", "--seed", "8"])
    return root


def test_reported_timings_reprice_the_steps_planned_afterwards(dataset):
    config = JobConfig(shards=(str(dataset),), seq_len=2048, dp_size=2, num_microbatches=2, cost_feedback=True)
    server, port, servicer = create_server("127.0.0.1:0", decode_workers=0)
    try:
        reference = Job(config)  # the same plans, to know each microbatch's features
        with DataClient(f"127.0.0.1:{port}", config, 0, prefetch=1) as client:
            got = [next(client) for _ in range(4)]  # steps 0 and 1
            timings = []
            for rank in (0, 1):
                for step in (0, 1):
                    plan = reference.step_plan(step)
                    for index in range(plan.num_microbatches):
                        features = microbatch_features(plan.microbatch(rank, index))
                        timings.append((step, rank, index, *_measured(features)))
            request_by_rank = {r: [(s, i, *sec) for s, rr, i, *sec in timings if rr == r] for r in (0, 1)}
            client.report_timings(request_by_rank[0])
            with DataClient(f"127.0.0.1:{port}", config, 1) as other:
                ack = other.report_timings(request_by_rank[1])
        assert ack.num_observations == len(timings)
        assert ack.cost.bb_linear_s == pytest.approx(TRUE.bb_linear_s, rel=1e-4)
        assert ack.cost.enc_linear_s == pytest.approx(TRUE.enc_linear_s, rel=1e-3)
        assert got[0].step == 0
        refit = CostConfig(**{f.name: getattr(ack.cost, f.name) for f in dataclasses.fields(CostConfig)})
        job = servicer.jobs.get(config.job_id())
        later = job.step_plan(ack.first_step_priced)
        for seq in later.sequences:
            if seq.documents:
                assert seq.cost == price(seq, refit), "steps planned after the report use the refit"
        first = job.step_plan(0)
        assert any(seq.cost != price(seq, TRUE) for seq in first.sequences if seq.documents), \
            "steps planned before the report keep their prices"
        assert price_sequence(image_tokens=[], document_lengths=[], num_generated_images=0, config=TRUE).total_s == 0
    finally:
        server.stop(0).wait()


def test_timings_for_a_job_without_feedback_are_refused(tmp_path):
    write_tiny_shards(tmp_path, num_shards=1, samples_per_shard=6)
    server, port, _ = create_server("127.0.0.1:0", decode_workers=0)
    try:
        with DataClient(f"127.0.0.1:{port}", JobConfig(shards=(str(tmp_path),), seq_len=2048), 0) as client:
            with pytest.raises(grpc.RpcError) as info:
                client.report_timings([(0, 0, 1.0, 1.0, 0.0)])
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "without cost_feedback" in info.value.details()
    finally:
        server.stop(0).wait()
