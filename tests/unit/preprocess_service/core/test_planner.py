"""The planner's blocks: sizes ramp up at an epoch's start, a far block is reached by seeking
(the same documents as reading up to it), and the state stays a few hundred bytes."""

import json

import numpy as np
import pytest

from disttrain_api.config import JobConfig
from preprocess_service.core.planner import RAMP_BLOCK, EpochPlanner
from preprocess_service.core.sample import Document, TextSegment


class Rows:
    """A DocumentSource of shards whose samples are rows of known count: shard i has sizes[i]."""

    fingerprint = ""

    def __init__(self, sizes):
        self.sizes = sizes
        self.urls = [f"s{i:03d}" for i in range(len(sizes))]
        self.reads = 0

    def iter_shard(self, url, on_problem, start=None, dataset=None):
        index = self.urls.index(url)
        for row in range(int((start or {}).get("samples", 0)), int(self.sizes[index])):
            self.reads += 1
            yield {"__key__": f"{url}-{row}", "__url__": url, "tokens": 5 + (index * 7 + row * 3) % 40}

    def read_samples(self, url, keys):
        return {}

    def shard_keys(self, url, limit=None):
        index = self.urls.index(url)
        return (f"{url}-{row}" for row in range(int(self.sizes[index]) if limit is None else limit))

    def parse(self, sample):
        ids = np.zeros(sample["tokens"], dtype=np.int32)
        return Document(key=sample["__key__"], shard=sample["__url__"], segments=(TextSegment("txt", ids),))

    def skipped(self, problem):
        raise AssertionError(f"nothing here is bad: {problem}")


def _config(**extra):
    return JobConfig(shards=("x",), seq_len=256, dp_size=2, num_microbatches=2, shuffle_buffer=1000, open_shards=3,
                     reorder_algorithm="arrival", **extra)


def test_block_sizes_ramp_up_then_hold_the_shuffle_buffer():
    planner = EpochPlanner(_config(), ["a"], Rows([1]))
    sizes = [planner.block_size(b) for b in range(6)]
    assert sizes == [RAMP_BLOCK, 2 * RAMP_BLOCK, 1000, 1000, 1000, 1000]
    assert [planner.block_start(b) for b in range(5)] == [0, 256, 768, 1768, 2768]


@pytest.mark.parametrize("dedup", ["shard", "pass"])
def test_seeking_to_a_block_gives_the_documents_reading_up_to_it_gives(dedup):
    rng = np.random.default_rng(5)
    source = Rows(rng.integers(0, 300, size=40))
    config = _config(dedup=dedup)
    original = EpochPlanner(config, source.urls, source)
    blocks = []
    while not original._drained:
        original._read_block()
        blocks.append([d.key for seq in original._ready for d in seq.documents])
        original._ready.clear()
        original._blocks.clear()
    for target in (1, 3, 5, len(blocks) - 1):
        position = original.block_start(target)
        seeked = EpochPlanner(config, source.urls, Rows(source.sizes))
        assert seeked.seek(position + 17, source.sizes, step=0) == position  # the block holding it
        state = json.loads(json.dumps(seeked.state_dict()))
        assert len(json.dumps(state)) < 1000
        resumed = EpochPlanner(config, source.urls, Rows(source.sizes))
        resumed.load_state_dict(state)
        resumed._read_block()
        assert [d.key for seq in resumed._ready for d in seq.documents] == blocks[target], target


def test_a_job_failed_by_its_error_tolerance_stays_failed_after_a_restore():
    """The steps before the failure are planned; a state taken after them fails again on load,
    instead of going on from counters that were already over the limit."""
    from disttrain_api.errors import DataQualityError, SampleError

    class Bad(Rows):
        def parse(self, sample):
            if int(sample["__key__"].rsplit("-", 1)[1]) >= 20:
                raise SampleError(sample["__key__"], "bad", sample["__url__"], "parse_failed")
            return super().parse(sample)

        def skipped(self, problem):
            pass

    config = JobConfig(shards=("x",), seq_len=256, dp_size=2, num_microbatches=2, reorder_algorithm="arrival",
                       max_consecutive_errors=10, open_shards=1, max_error_fraction=1.0)
    planner = EpochPlanner(config, [f"s{i:03d}" for i in range(2)], Bad([200, 200]))
    plans = []
    with pytest.raises(DataQualityError, match="in a row"):
        while (plan := planner.next_plan()) is not None:
            plans.append(plan)
    assert plans, "the steps before the failure were planned"
    state = json.loads(json.dumps(planner.state_dict()))
    assert "in a row" in state["failure"]
    resumed = EpochPlanner(config, [f"s{i:03d}" for i in range(2)], Bad([200, 200]))
    resumed.load_state_dict(state)
    with pytest.raises(DataQualityError, match="in a row"):
        resumed.next_plan()
