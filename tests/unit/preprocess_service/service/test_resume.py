"""The state contract: shard cursor, planner (shuffle buffer, packer, key hashes) and job resume at
step k from a small state, with no replanning from step 0; plans are dropped on acknowledge."""

import gzip
import json

import pytest

from disttrain_api.config import JobConfig
from disttrain_api.errors import NotFoundError
from helpers import check_resumes, jpeg_bytes, write_tiny_shards
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
    assert len(json.dumps(states[len(plans) // 2])) < 8_000, "a small state: references, not documents"
    middle = states[len(plans) // 2]
    [dataset] = middle["datasets"]  # a version-1 state (before mixtures) still resumes to the same plans
    version1 = {key: value for key, value in middle.items() if key not in ("datasets", "blend", "epoch_docs",
                                                                            "totals", "fingerprint")}
    version1.update(version=1, cursor={k: dataset[k] for k in ("shard", "samples", "offset")}, seen=dataset["seen"])
    resumed = EpochPlanner(config, reader.expand(config.shards), Documents(reader, job.documents.parse_only))
    resumed.load_state_dict(version1)
    assert [_signature(p) for p in resumed] == plans[len(plans) // 2:]
    other_tokenizer = EpochPlanner(config, reader.expand(config.shards),
                                   Documents(reader, job.documents.parse_only, fingerprint="0f" * 32))
    with pytest.raises(ValueError, match="tokenizer file"):
        other_tokenizer.load_state_dict(middle)
    with pytest.raises(ValueError, match="version"):
        resumed.load_state_dict({**states[1], "version": 99})
    import base64
    import zlib

    for seen in (b"x" * 9, bytes(8 * ((1 << 27) + 1))):  # not whole hashes; more than the bound
        with pytest.raises(ValueError, match="8-byte hashes"):
            bad = [{**states[1]["datasets"][0], "seen": base64.b64encode(zlib.compress(seen)).decode()}]
            resumed.load_state_dict({**states[1], "datasets": bad})


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
