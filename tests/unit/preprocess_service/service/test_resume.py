"""The state contract: shard cursor, planner (a block's anchor) and job resume at step k from a
small state, with no replanning from step 0, also at another dp_size (elastic); plans are dropped
on acknowledge."""

import gzip
import json

import pytest

from disttrain_api.config import JobConfig
from disttrain_api.errors import NotFoundError
from helpers import check_resumes, jpeg_bytes, shard_keys, write_tiny_shards
from preprocess_service.adapters.io.shards import ShardReader
from preprocess_service.core.planner import Documents, EpochPlanner
from preprocess_service.core.sample import NEXT_OFFSET
from preprocess_service.service.job import Job


def _signature(plan) -> tuple:
    """Which documents each rank trains on, per microbatch, in order."""
    return plan.step, plan.epoch, tuple(
        tuple(tuple(doc.key for seq in plan.microbatch(rank, index) for doc in seq.documents)
              for index in range(plan.num_microbatches)) for rank in range(plan.assignment.shape[0]))


def _data(tmp_path, **extra):
    bad = {"99999bad": {"jpg": b"\xff\xd8 not a jpeg", "txt": b"x"},
           "000000001": {"jpg": jpeg_bytes(64, 64), "txt": b"a key shard 0 holds already"}}
    write_tiny_shards(tmp_path, num_shards=3, samples_per_shard=14, extra=bad)
    fields = dict(shards=(str(tmp_path),), seq_len=1024, dp_size=2, num_microbatches=2, seqs_per_microbatch=1,
                  shuffle_buffer=7, pack_window=3, num_epochs=2, max_error_fraction=1.0)
    return JobConfig(**{**fields, **extra})


@pytest.mark.parametrize("seekable", [True, False], ids=["seek", "scan"])
def test_shard_cursor_resumes_after_the_samples_read(tmp_path, seekable):
    [path, *_] = write_tiny_shards(tmp_path, num_shards=1, samples_per_shard=9)
    if not seekable:  # a gzipped tar cannot be seeked into: the cursor falls back to counting samples
        gz = tmp_path / "00000.tar.gz"
        gz.write_bytes(gzip.compress(path.read_bytes()))
        path = gz
    reader = ShardReader()
    full = list(reader.iter_shard(str(path), print))
    assert len(full) == 9 and full[-1][NEXT_OFFSET] == -1
    assert all(isinstance(s.get(NEXT_OFFSET), int) for s in full) == seekable
    for n in (1, 4, 8, 9):
        cursor = {"samples": n, "offset": full[n - 1].get(NEXT_OFFSET)}
        rest = list(reader.iter_shard(str(path), print, cursor))
        assert [s["__key__"] for s in rest] == [s["__key__"] for s in full[n:]]
        assert all(r["jpg"] == f["jpg"] for r, f in zip(rest, full[n:]))


def test_planner_resumed_from_its_state_at_any_step_plans_what_the_original_planned(tmp_path):
    config = _data(tmp_path)
    reader = ShardReader()
    job = Job(config)  # only for its parse function
    skipped = []
    def make():
        return EpochPlanner(config, reader.expand(config.shards),
                            Documents(reader, job.documents.parse_only, skipped.append))

    def advance(planner):
        plan = planner.next_plan()
        return None if plan is None else _signature(plan)

    plans, states = check_resumes(make, advance, at=lambda n: (1, n // 2, n // 2 + 1, n - 1))  # helpers.py
    assert len({p[1] for p in plans}) == 2, "two epochs"
    assert {e.kind for e in skipped} >= {"unreadable_image", "duplicate_key"}
    assert max(len(json.dumps(state)) for state in states) < 4_000, "a few numbers per open shard, no keys"
    middle = max(states[1:], key=lambda state: state["taken"])
    assert middle["taken"] > 0, "resumed inside a block: its sequences rebuilt from the anchor"
    other_tokenizer = EpochPlanner(config, reader.expand(config.shards),
                                   Documents(reader, job.documents.parse_only, fingerprint="0f" * 32))
    with pytest.raises(ValueError, match="tokenizer file"):
        other_tokenizer.load_state_dict(middle)
    resumed = EpochPlanner(config, reader.expand(config.shards), Documents(reader, job.documents.parse_only))
    for version in (1, 2, 99):  # 1 and 2 held key hashes and buffered documents: replanned from step 0
        with pytest.raises(ValueError, match="version"):
            resumed.load_state_dict({**states[1], "version": version})
    with pytest.raises(ValueError, match="packs fewer"):  # a state naming more sequences than its block packs
        resumed.load_state_dict({**middle, "taken": 10_000})


def test_a_restarted_job_continues_at_the_acknowledged_step_and_plans_are_dropped(tmp_path):
    config = _data(tmp_path)
    original = Job(config, snapshot_every=3)
    num_steps = original.plan_all()
    want = [_signature(original.step_plan(s)) for s in range(num_steps)]
    assert original.plans.num_held_plans() == num_steps
    ack = num_steps - 3
    for rank in range(config.dp_size):
        original.acknowledge(rank, ack)
    assert original.plans.num_held_plans() == num_steps - ack, "acknowledged plans are dropped"
    with pytest.raises(NotFoundError, match="acknowledged"):
        original.step_plan(ack - 1)
    state = json.loads(json.dumps(original.state_dict()))
    assert state["snapshot_step"] <= ack and ack - state["snapshot_step"] < 3

    restarted = Job(config, snapshot_every=3)
    restarted.load_state_dict(state)
    assert [_signature(restarted.step_plan(s)) for s in range(ack, num_steps)] == want[ack:]
    assert restarted.step_plan(num_steps) is None and restarted.num_steps() == num_steps
    with pytest.raises(NotFoundError):
        restarted.step_plan(state["snapshot_step"] - 1)
    other = Job(_data(tmp_path, seed=5))
    with pytest.raises(ValueError, match="does not belong"):
        other.load_state_dict(state)


def test_a_node_restarted_with_a_state_dir_reopens_the_job_at_its_acknowledged_step(tmp_path):
    from preprocess_service.service.job import JobRegistry

    config = _data(tmp_path / "data", num_epochs=4)  # more steps than the planner-state interval (16)
    first = JobRegistry(state_dir=tmp_path / "state")
    job = first.open(config)
    num_steps = job.plan_all()
    want = [_signature(job.step_plan(s)) for s in range(num_steps)]
    for rank in range(config.dp_size):
        job.acknowledge(rank, num_steps - 2)
    saved = tmp_path / "state" / f"{job.job_id}.json"
    assert json.loads(saved.read_text())["acked"] == {"0": num_steps - 2, "1": num_steps - 2}
    assert (tmp_path / "state" / f"{config.lineage_id()}.json").read_text() == saved.read_text()
    first.close()

    restarted = JobRegistry(state_dir=tmp_path / "state").open(config)  # the same job after a restart
    resumed_at = json.loads(saved.read_text())["snapshot_step"]
    assert resumed_at > 0, "resumed from a planner state, not from step 0"
    with pytest.raises(NotFoundError):
        restarted.step_plan(resumed_at - 1)
    assert [_signature(restarted.step_plan(s)) for s in range(num_steps - 2, num_steps)] == want[-2:]
    saved.write_text("{not json")
    fresh = JobRegistry(state_dir=tmp_path / "state").open(config)  # a damaged state: replans from 0, says so
    assert _signature(fresh.step_plan(0)) == want[0]


def test_the_round_trip_harness_fails_a_part_that_forgets_part_of_its_state():
    class Counter:  # forgets its running total on load
        def __init__(self):
            self.n, self.total = 0, 0

        def state_dict(self):
            return {"n": self.n, "total": self.total}

        def load_state_dict(self, state):
            self.n = state["n"]

    def advance(counter):
        if counter.n == 6:
            return None
        counter.n += 1
        counter.total += counter.n
        return counter.total

    with pytest.raises(AssertionError, match="resumed at step"):
        check_resumes(Counter, advance)


@pytest.mark.parametrize("restart", [True, False], ids=["node-restarted", "service-running"])
def test_elastic_resume_8_6_12_delivers_every_sample_of_the_epoch_once(tmp_path, restart):
    """A job checkpointed at dp_size 8 resumes at 6, then at 12, twice within one epoch, over real
    shards (with a cross-shard duplicate and a bad sample): every sample is planned exactly once.
    Restarted: the service restarts each time and continues from its state_dir; running: the new
    job continues from the open job of its lineage."""
    from preprocess_service.service.job import JobRegistry

    paths = write_tiny_shards(tmp_path / "data", num_shards=6, samples_per_shard=40,
                              extra={"99999bad": {"jpg": b"\xff\xd8 not a jpeg", "txt": b"x"},
                                     "000010001": {"jpg": jpeg_bytes(64, 64), "txt": b"a copy of shard 1's"}})
    base = dict(shards=(str(tmp_path / "data"),), seq_len=1024, num_microbatches=1, seqs_per_microbatch=1,
                shuffle_buffer=64, open_shards=3, pack_window=3, max_error_fraction=1.0)
    state_dir = tmp_path / "state"
    delivered: list[tuple[str, str]] = []
    skipped: set[tuple[str, str]] = set()
    layouts = []
    running = JobRegistry()
    for dp_size, steps in ((8, 3), (6, 4), (12, None)):
        registry = JobRegistry(state_dir=state_dir) if restart else running
        config = JobConfig(dp_size=dp_size, **base)
        if layouts:  # the trainer asks for it (DataClient.load_state_dict): never implicit
            assert registry.open(config).plans.first_step() == 0, "a job of another layout does not continue alone"
            job = registry.continue_lineage(config, layouts[-1][2], client="")
        else:
            job = registry.open(config)
        start = job.plans.state_dict()["acked_step"] if layouts else 0
        if layouts:
            with pytest.raises(NotFoundError):
                job.step_plan(start - 1)  # continues at the acknowledged step, not from 0
        step = start
        while (plan := job.step_plan(step)) is not None and (steps is None or step < start + steps):
            assert plan.assignment.shape[0] == dp_size
            delivered += [(doc.shard, doc.key) for doc in plan.documents()]
            step += 1
        for rank in range(dp_size):
            job.acknowledge(rank, step)
        layouts.append((dp_size, start, step))
        skipped |= {(r.shard, r.key) for r in job.report()["skipped"]}
        if restart:
            registry.close()
    running.close()
    assert [d for d, _, _ in layouts] == [8, 6, 12] and layouts[1][1] == 3 and layouts[2][1] == 7
    everything = {(str(p), k) for p in paths for k in shard_keys([p])}
    assert len(delivered) == len({k for _, k in delivered}), "no key repeated across the layout changes"
    lost = everything - set(delivered) - {(s, k) for s, k in skipped}
    assert not lost, sorted(lost)[:5]
    assert {k for _, k in skipped} >= {"000010001", "99999bad"}, "the cross-shard copy and the bad one reported"
    with pytest.raises(NotFoundError, match="acknowledged step 5"):  # a step nobody acknowledged: refused
        JobRegistry(state_dir=state_dir).continue_lineage(JobConfig(dp_size=3, **base), 5, client="")


def test_a_full_state_disk_fails_no_acknowledgement_keeps_the_saved_state_and_saves_again_later(tmp_path, caplog):
    """state_dir on a real 256 KiB tmpfs, filled: acknowledgements go on, the state saved before
    stays whole, the failure is said once, and the state refused is written by itself once space
    returns (a job may acknowledge its last step on the full disk)."""
    import os
    import subprocess
    import time

    from preprocess_service.service.job import JobRegistry

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    state = tmp_path / "state"
    state.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(state)]).returncode != 0:
        pytest.skip("tmpfs cannot be mounted here")
    try:
        config = _data(tmp_path / "data", num_epochs=2)
        registry = JobRegistry(state_dir=state)
        job = registry.open(config)
        num_steps = job.plan_all()
        assert num_steps >= 4
        for rank in range(config.dp_size):
            job.acknowledge(rank, 1)
        saved = state / f"{job.job_id}.json"
        before = saved.read_text()
        assert json.loads(before)["acked"] == {"0": 1, "1": 1}
        filler = state / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)  # every byte the tmpfs has left
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError:
            pass
        finally:
            os.close(fd)
        for rank in range(config.dp_size):
            assert job.acknowledge(rank, 3) == (1 if rank == 0 else 3)  # no error reaches the trainer
        assert saved.read_text() == before, "the state saved before is whole"
        assert not [p for p in state.iterdir() if p.name.endswith(".tmp")], "no partial file left behind"
        assert sum("cannot save its state" in r.getMessage() for r in caplog.records) == 1
        assert any("cannot be saved to state_dir" in w for w in job.summary()["warnings"])  # and in status
        subprocess.run(["mount", "-o", "remount,ro", str(state)], check=True)  # a read-only disk: the same
        for rank in range(config.dp_size):
            job.acknowledge(rank, 3)
        assert saved.read_text() == before
        subprocess.run(["mount", "-o", "remount,rw", str(state)], check=True)
        filler.unlink()  # space returns: the refused state lands by itself, with no acknowledgement after it
        deadline = time.monotonic() + 30
        while json.loads(saved.read_text())["acked"] != {"0": 3, "1": 3}:
            assert time.monotonic() < deadline, "the state refused by the full disk was not written again"
            time.sleep(0.1)
        assert any("saved again" in r.getMessage() for r in caplog.records)
        assert job.summary()["warnings"] == []
        assert registry.factory.state_files.num_unsaved() == 0
        for rank in range(config.dp_size):
            job.acknowledge(rank, 4)
        assert json.loads(saved.read_text())["acked"] == {"0": 4, "1": 4}
        registry.close()
    finally:
        subprocess.run(["umount", str(state)], check=False)


def test_elastic_resume_after_the_end_of_the_data_is_refused_with_the_reason(tmp_path):
    """Every step acknowledged at the end of the data: the planner keeps no state there, so another
    layout cannot continue at that step; NotFoundError says so (it was a raw ValueError, which the
    client got as UNKNOWN)."""
    from preprocess_service.service.job import JobRegistry

    write_tiny_shards(tmp_path / "data", num_shards=2, samples_per_shard=12)
    base = dict(shards=(str(tmp_path / "data"),), seq_len=1024, num_microbatches=1, seed=1)
    registry = JobRegistry()
    job = registry.open(JobConfig(dp_size=2, **base))
    num_steps = job.plan_all()
    for rank in range(2):
        job.acknowledge(rank, num_steps)
    with pytest.raises(NotFoundError, match=f"acknowledged step {num_steps} holds no planner state"):
        registry.continue_lineage(JobConfig(dp_size=1, **base), num_steps, client="")
