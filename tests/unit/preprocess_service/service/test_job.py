"""Job-level behaviour without gRPC: released bytes are re-read identically; acknowledgements."""

import numpy as np

from disttrain_api.config import JobConfig
from helpers import write_tiny_shards
from preprocess_service.adapters.decode import InlineDecoder
from preprocess_service.service.job import Job

DECODER = InlineDecoder()


def _arrays(job, step, rank, index):
    return job.microbatch(job.step_plan(step), rank, index, DECODER).arrays


def _same_epoch(got: Job, want: Job) -> int:
    num_steps = got.plan_all()
    assert num_steps == want.plan_all() >= 3
    for step in range(num_steps):
        for rank in range(got.config.dp_size):
            for index in range(got.step_plan(step).num_microbatches):
                a, b = _arrays(got, step, rank, index), _arrays(want, step, rank, index)
                assert a.keys() == b.keys()
                for name in b:
                    np.testing.assert_array_equal(a[name], b[name], err_msg=f"{name} step {step}")
    return num_steps


def test_a_job_holds_no_encoded_bytes_of_local_plain_tars_and_delivers_the_same(tmp_path):
    """Planning holds none of a local plain tar's encoded bytes (not in the planned block or the
    planned steps) and charges none to the budget: each microbatch's samples are
    read again by pread when it is decoded, and equal those of the same shards compressed, whose
    bytes the job held."""
    from preprocess_service.adapters.infra.budget import MemoryBudget
    from preprocess_service.adapters.io.shards import ShardReader

    write_tiny_shards(tmp_path / "plain", num_shards=2, samples_per_shard=20)
    write_tiny_shards(tmp_path / "gz", num_shards=2, samples_per_shard=20, compress=True)
    reader = ShardReader()
    assert reader.rereads_cheaply(str(tmp_path / "plain" / "00000.tar"))
    assert not reader.rereads_cheaply(str(tmp_path / "gz" / "00000.tar"))

    def config(folder):
        return JobConfig(shards=(str(tmp_path / folder),), seq_len=1024, dp_size=2, num_microbatches=2,
                         shuffle_buffer=16)

    budget = MemoryBudget(1 << 30)
    lean, held = Job(config("plain"), budget=budget), Job(config("gz"), retain_steps=1000)
    lean.step_plan(0)
    held.step_plan(0)
    def block(job):  # the planned block's documents not yet in a step
        return [doc for seq in job.plans.planner._ready for doc in seq.documents]

    assert block(lean) and block(held)
    assert all(doc.media_bytes is None for doc in block(lean))
    assert all(doc.media_bytes is None for doc in lean.step_plan(0).documents())
    assert lean.retention.held_bytes == 0 and budget.used == 0
    assert held.retention.held_bytes > 0 and any(doc.media_bytes for doc in block(held))
    _same_epoch(lean, held)
    assert not lean.report()["skipped"]


def test_a_step_whose_bytes_were_released_is_rebuilt_identically(tmp_path):
    write_tiny_shards(tmp_path, num_shards=2, samples_per_shard=20, compress=True)
    config = JobConfig(shards=(str(tmp_path),), seq_len=1024, dp_size=2, num_microbatches=2)
    keeper = Job(config, retain_steps=1000)
    lean = Job(config, retain_steps=1)
    lean.plan_all()
    assert any(doc.media_bytes for doc in keeper.step_plan(0).documents())
    first = lean.step_plan(0)
    assert all(doc.media_bytes is None for doc in first.documents()), "old steps should hold no bytes"
    _same_epoch(lean, keeper)
    assert not lean.report()["skipped"]


def test_bytes_are_dropped_once_every_rank_was_sent_the_step(tmp_path):
    write_tiny_shards(tmp_path, num_shards=1, samples_per_shard=20, compress=True)
    job = Job(JobConfig(shards=(str(tmp_path),), seq_len=1024, dp_size=2, num_microbatches=2))
    plan = job.step_plan(0)
    job.plans.mark_sent(0, 0, plan.num_microbatches)
    assert all(doc.media_bytes is not None for doc in plan.documents() if doc.images)
    job.plans.mark_sent(1, 0, plan.num_microbatches)
    assert all(doc.media_bytes is None for doc in plan.documents())


def test_acknowledgements_report_the_slowest_rank(tmp_path):
    write_tiny_shards(tmp_path, num_shards=1, samples_per_shard=4)
    job = Job(JobConfig(shards=(str(tmp_path),), dp_size=3))
    assert job.acknowledge(0, 5) == 0
    assert job.acknowledge(1, 3) == 0
    assert job.acknowledge(2, 4) == 3
    assert job.acknowledge(1, 2) == 3  # never goes back


def _plan_ahead_threads():
    import threading

    return [t for t in threading.enumerate() if t.name.startswith("plan-ahead:")]


def test_opening_a_job_plans_its_first_step_before_any_stream_asks(tmp_path):
    """A job's ranks usually start with the service (importing torch takes them a second): the
    first step is read and planned meanwhile, so their first microbatches need only decoding."""
    import time

    from preprocess_service.service.job import JobRegistry

    write_tiny_shards(tmp_path, num_shards=2, samples_per_shard=8)
    registry = JobRegistry()
    job = registry.open(JobConfig(shards=(str(tmp_path),), seq_len=512, dp_size=2, num_microbatches=2))
    deadline = time.monotonic() + 60
    while job.plans.num_held_plans() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert job.plans.num_held_plans() == 1  # step 0, planned with no stream open; nothing further
    assert registry.open(job.config) is job  # opening it again joins it and plans nothing more
    for thread in _plan_ahead_threads():
        thread.join(60)
    assert job.plans.num_held_plans() == 1
    registry.close()


def test_a_job_closed_while_it_plans_ahead_keeps_no_bytes_charged(tmp_path):
    from preprocess_service.adapters.infra.budget import MemoryBudget
    from preprocess_service.service.job import JobRegistry

    write_tiny_shards(tmp_path, num_shards=2, samples_per_shard=8, compress=True)
    budget = MemoryBudget(1 << 30)
    registry = JobRegistry(budget)
    for seed in range(5):  # closed at different moments of its first step's planning
        job = registry.open(JobConfig(shards=(str(tmp_path),), seq_len=512, dp_size=2, num_microbatches=2,
                                      seed=seed))
        registry.close_job(job.job_id)
        for thread in _plan_ahead_threads():
            thread.join(60)
        assert job.plans.num_held_plans() == 0
        assert job.retention.held_bytes == 0 and budget.used == 0, seed


def test_a_microbatch_handed_to_the_decoder_holds_no_encoded_bytes_and_is_rebuilt_the_same(tmp_path):
    """The decoder copied them: the plan drops them at once (a service holds only what is planned
    and not yet decoding), and a stream that asks for the microbatch again gets it re-read, equal."""
    write_tiny_shards(tmp_path, num_shards=1, samples_per_shard=20, compress=True)
    job = Job(JobConfig(shards=(str(tmp_path),), seq_len=1024, dp_size=2, num_microbatches=2))
    plan = job.step_plan(0)
    held = job.retention.held_bytes
    assert held > 0
    first = job.microbatch(plan, 0, 0, DECODER)
    started = [doc for seq in plan.microbatch(0, 0) for doc in seq.documents]
    others = [doc for seq in plan.microbatch(1, 0) for doc in seq.documents if doc.images]
    assert started and all(doc.media_bytes is None for doc in started)
    assert others and all(doc.media_bytes is not None for doc in others)
    assert 0 < job.retention.held_bytes < held
    again = job.microbatch(plan, 0, 0, DECODER)
    for name in first.arrays:
        np.testing.assert_array_equal(again.arrays[name], first.arrays[name], err_msg=name)


def test_a_job_over_patterns_held_lazily_reads_their_shards_and_reports_a_missing_one(tmp_path, monkeypatch):
    """Patterns larger than EAGER_NAMES are held as patterns (their names made when a shard opens):
    a shard missing in the middle is reported by name and every other sample is planned once; a
    mixture's datasets parse with their own settings; a shard in two datasets is still refused."""
    import pytest

    from disttrain_api.config import DatasetConfig
    from disttrain_api.errors import ConfigError
    from preprocess_service.adapters.io import sources
    from preprocess_service.service.documents import expand_datasets

    monkeypatch.setattr(sources, "EAGER_NAMES", 2)
    monkeypatch.setattr(sources, "SPOT_CHECKS", 2)
    paths = write_tiny_shards(tmp_path, num_shards=6, samples_per_shard=8)
    paths[2].unlink()
    pattern = str(tmp_path / "{00000..00005}.tar")
    job = Job(JobConfig(shards=(pattern,), seq_len=1024, dp_size=2, num_microbatches=2, shuffle_buffer=16))
    assert isinstance(job.dataset_urls[0], sources.PatternNames) and len(job.shard_urls) == 6
    job.plan_all()
    keys = sorted(doc.key for step in range(job.num_steps()) for doc in job.step_plan(step).documents())
    assert keys == sorted(f"{s:05d}{i:04d}" for s in (0, 1, 3, 4, 5) for i in range(8))
    missing = [r for r in job.report()["skipped"] if r.shard == str(paths[2])]
    assert len(missing) == 1 and missing[0].kind == "shard_error" and "cannot open" in missing[0].reason

    mixture = JobConfig(datasets=(DatasetConfig(name="images", shards=(str(tmp_path / "{00000..00001}.tar"),)),
                                  DatasetConfig(name="text", shards=(str(tmp_path / "{00003..00005}.tar"),),
                                                modalities=("text",))),
                        seq_len=1024, dp_size=2, num_microbatches=2, shuffle_buffer=16)
    mixed = Job(mixture)
    mixed.plan_all()
    docs = [doc for step in range(mixed.num_steps()) for doc in mixed.step_plan(step).documents()]
    assert {doc.dataset for doc in docs if doc.shard < str(paths[2])} == {0}
    assert {doc.dataset for doc in docs if doc.shard > str(paths[2])} == {1}
    assert not any(doc.images for doc in docs if doc.dataset == 1) and any(doc.images for doc in docs)
    overlapping = JobConfig(datasets=(DatasetConfig(name="a", shards=(str(tmp_path / "{00000..00003}.tar"),)),
                                      DatasetConfig(name="b", shards=(str(tmp_path / "{00003..00005}.tar"),))))
    with pytest.raises(ConfigError, match="00003.tar' is in datasets 'a' and 'b'"):
        expand_datasets(job.reader, overlapping)


def test_a_lazy_name_the_policy_refuses_is_reported_as_its_shard_and_the_rest_is_planned(tmp_path, monkeypatch):
    from preprocess_service.adapters.io import sources
    from preprocess_service.adapters.io.shards import ShardReader
    from preprocess_service.adapters.io.sources import ShardPolicy

    monkeypatch.setattr(sources, "EAGER_NAMES", 2)
    monkeypatch.setattr(sources, "SPOT_CHECKS", 2)  # first and last: the middle name is made only when opened
    write_tiny_shards(tmp_path / "ok", num_shards=2, samples_per_shard=6)
    (tmp_path / "outside").mkdir()
    spec = f"{{{tmp_path}/ok/00000.tar,{tmp_path}/outside/x.tar,{tmp_path}/ok/00001.tar}}"
    reader = ShardReader(policy=ShardPolicy(allowed_prefixes=(str(tmp_path / "ok"),)))
    job = Job(JobConfig(shards=(spec,), seq_len=1024, dp_size=2, num_microbatches=2, shuffle_buffer=16), reader=reader)
    assert len(job.shard_urls) == 3 and job.listed_shards(10)[1] == ""
    job.plan_all()
    keys = sorted(doc.key for step in range(job.num_steps()) for doc in job.step_plan(step).documents())
    assert keys == sorted(f"{s:05d}{i:04d}" for s in (0, 1) for i in range(6))
    refused = [r for r in job.report()["skipped"] if r.kind == "shard_error"]
    assert len(refused) == 1 and "outside the prefixes" in refused[0].reason


def test_lazy_local_names_are_looked_up_as_made_and_a_pattern_of_folders_is_expanded(tmp_path, monkeypatch):
    import os

    from preprocess_service.adapters.io import sources

    monkeypatch.setattr(sources, "EAGER_NAMES", 2)
    monkeypatch.setattr(sources, "SPOT_CHECKS", 2)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for i in range(20):
        (tmp_path / "a" / f"s{i:02d}.tar").write_bytes(b"")
    (tmp_path / "a" / "s07.tar").unlink()
    (tmp_path / "b" / "x.tar").write_bytes(b"")
    os.symlink(tmp_path / "b" / "x.tar", tmp_path / "a" / "s07.tar")  # one name of the pattern is a link
    names = sources.resolve_names([f"{tmp_path}/a/s{{00..19}}.tar"])
    assert isinstance(names, sources.PatternNames) and names[7] == str(tmp_path / "b" / "x.tar")
    assert names.position(names[7]) == 7 and list(names.quick_names())[7] == names[7]
    write_tiny_shards(tmp_path / "d0", num_shards=2, samples_per_shard=2)
    write_tiny_shards(tmp_path / "d1", num_shards=2, samples_per_shard=2)
    for i in range(2, 6):
        (tmp_path / f"d{i}").mkdir()
        (tmp_path / f"d{i}" / "00000.tar").write_bytes(b"")
    folders = sources.resolve_names([f"{tmp_path}/d{{0..5}}"])  # folders: their tars, as eager expansion gives
    assert list(folders) == [str(tmp_path / "d0" / "00000.tar"), str(tmp_path / "d0" / "00001.tar"),
                             str(tmp_path / "d1" / "00000.tar"), str(tmp_path / "d1" / "00001.tar"),
                             *(str(tmp_path / f"d{i}" / "00000.tar") for i in range(2, 6))]


def test_status_prints_each_warning_under_its_job():
    from disttrain_api import preprocess_pb2 as pb
    from preprocess_service.service.cli import _jobs_text

    calm = pb.JobSummary(job_id="job-a", dp_size=2, datasets=["default"])
    worried = pb.JobSummary(job_id="job-b", dp_size=2, datasets=["default"],
                            warnings=["Redis lost acknowledged writes 1 time(s)"])
    lines = _jobs_text([calm, worried]).splitlines()
    at = next(i for i, line in enumerate(lines) if "job-b" in line)
    assert lines[at + 1].strip() == "warning: Redis lost acknowledged writes 1 time(s)"
    assert not any("warning" in line for line in lines[:at])
