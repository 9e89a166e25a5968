"""Job-level behaviour without gRPC: released bytes are re-read identically; acknowledgements."""

import numpy as np

from disttrain_api.config import JobConfig
from helpers import write_tiny_shards
from preprocess_service.adapters.decode import InlineDecoder
from preprocess_service.service.job import Job

DECODER = InlineDecoder()


def _arrays(job, step, rank, index):
    return job.microbatch(job.step_plan(step), rank, index, DECODER).arrays


def test_a_step_whose_bytes_were_released_is_rebuilt_identically(tmp_path):
    write_tiny_shards(tmp_path, num_shards=2, samples_per_shard=20)
    config = JobConfig(shards=(str(tmp_path),), seq_len=1024, dp_size=2, num_microbatches=2)
    keeper = Job(config, retain_steps=1000)
    lean = Job(config, retain_steps=1)
    num_steps = lean.plan_all()
    assert num_steps == keeper.plan_all() >= 3
    first = lean.step_plan(0)
    assert all(doc.media_bytes is None for doc in first.documents()), "old steps should hold no bytes"
    for step in range(num_steps):
        for rank in range(2):
            for index in range(lean.step_plan(step).num_microbatches):
                got, want = _arrays(lean, step, rank, index), _arrays(keeper, step, rank, index)
                assert got.keys() == want.keys()
                for name in want:
                    np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} step {step}")
    assert not lean.report()["skipped"]


def test_bytes_are_dropped_once_every_rank_was_sent_the_step(tmp_path):
    write_tiny_shards(tmp_path, num_shards=1, samples_per_shard=20)
    job = Job(JobConfig(shards=(str(tmp_path),), seq_len=1024, dp_size=2, num_microbatches=2))
    plan = job.step_plan(0)
    job.mark_sent(0, 0, plan.num_microbatches)
    assert all(doc.media_bytes is not None for doc in plan.documents() if doc.images)
    job.mark_sent(1, 0, plan.num_microbatches)
    assert all(doc.media_bytes is None for doc in plan.documents())


def test_acknowledgements_report_the_slowest_rank(tmp_path):
    write_tiny_shards(tmp_path, num_shards=1, samples_per_shard=4)
    job = Job(JobConfig(shards=(str(tmp_path),), dp_size=3))
    assert job.acknowledge(0, 5) == 0
    assert job.acknowledge(1, 3) == 0
    assert job.acknowledge(2, 4) == 3
    assert job.acknowledge(1, 2) == 3  # never goes back
