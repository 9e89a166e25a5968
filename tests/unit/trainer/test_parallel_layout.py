"""ParallelLayout: data-parallel rank and size under tensor, context and pipeline parallelism
(tensor fastest, then context, data, pipeline), and which rank of a data-parallel group reads."""

import pytest

from disttrain_api.config import JobConfig
from trainer.data import ParallelLayout, ServiceDataset


def test_ranks_map_tensor_fastest_then_context_data_pipeline():
    # 16 processes: TP 2 x CP 2 x DP 2 x PP 2
    layouts = [ParallelLayout(r, 16, tensor=2, context=2, pipeline=2) for r in range(16)]
    assert {layout.dp_size for layout in layouts} == {2}
    assert [layout.dp_rank for layout in layouts] == [0, 0, 0, 0, 1, 1, 1, 1] * 2
    assert [r for r, layout in enumerate(layouts) if layout.reads_data] == [0, 4]
    plain = [ParallelLayout(r, 4) for r in range(4)]  # DDP/FSDP: every rank its own data
    assert [(p.dp_rank, p.dp_size, p.reads_data) for p in plain] == [(r, 4, True) for r in range(4)]
    with pytest.raises(ValueError, match="not a multiple"):
        ParallelLayout(0, 6, tensor=4)


def test_a_dataset_refuses_a_rank_that_does_not_read_or_a_job_of_another_size():
    config = JobConfig(shards=("x",), dp_size=2)
    with pytest.raises(ValueError, match="not the rank of its data-parallel group that reads"):
        ServiceDataset("127.0.0.1:1", config, ParallelLayout(1, 4, tensor=2))
    with pytest.raises(ValueError, match="dp_size 2.*4 data-parallel ranks"):
        ServiceDataset("127.0.0.1:1", config, ParallelLayout(0, 4))
    ServiceDataset("127.0.0.1:1", config, ParallelLayout(2, 4, tensor=2))  # made lazily: no connection yet
