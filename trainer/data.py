"""Any training loop: the service's microbatches as a ``torch.utils.data.IterableDataset``.

    layout = ParallelLayout.from_torch(tensor=2)            # after init_process_group; or given
    dataset = ServiceDataset("preproc:50051", config, layout)
    loader = DataLoader(dataset, batch_size=None)           # one Microbatch per item, as planned
    for mb in loader:
        ...
        if step_done and time_to_checkpoint:
            ckpt["data"] = dataset.state_dict()             # also acknowledges the step to the service

The service already batches, packs, orders and decodes; the dataset hands out its microbatches
unchanged, so use ``batch_size=None`` and ``num_workers=0`` (the client prefetches on a thread of
its own). Ranks: a job's data-parallel rank is what the service plans for, and every rank of one
data-parallel group (its tensor, context and pipeline ranks) trains on the same microbatches. As in
Megatron-LM, one rank of each group reads (``layout.reads_data``) and the others get the batch
from it; ``ServiceDataset`` on any other rank raises, rather than opening a second stream of the
same data-parallel rank (the service would end the first).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils.data import IterableDataset, get_worker_info

from disttrain_api.config import JobConfig
from trainer.client import DataClient

ORDER = "tp-cp-dp-pp"
"""How global ranks map to (tensor, context, data, pipeline) ranks: tensor fastest, pipeline
slowest (Megatron-LM's default order without expert parallelism)."""


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """This process's place in a TP x CP x DP x PP layout (ORDER)."""

    rank: int
    world_size: int
    tensor: int = 1
    """Tensor-parallel size."""
    context: int = 1
    """Context-parallel size."""
    pipeline: int = 1
    """Pipeline-parallel size."""

    def __post_init__(self) -> None:
        model = self.tensor * self.context * self.pipeline
        if min(self.tensor, self.context, self.pipeline) < 1 or self.world_size % model:
            raise ValueError(f"world size {self.world_size} is not a multiple of tensor x context x pipeline "
                             f"= {self.tensor} x {self.context} x {self.pipeline}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside the world size {self.world_size}")

    @classmethod
    def from_torch(cls, *, tensor: int = 1, context: int = 1, pipeline: int = 1) -> ParallelLayout:
        """The layout of this process from torch.distributed (initialised), with the model's sizes."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return cls(0, 1, tensor, context, pipeline)
        return cls(dist.get_rank(), dist.get_world_size(), tensor, context, pipeline)

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tensor * self.context * self.pipeline)

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tensor * self.context) % self.dp_size

    @property
    def reads_data(self) -> bool:
        """Whether this rank reads its group's microbatches: the first tensor, context and pipeline rank."""
        return self.rank % (self.tensor * self.context) == 0 and \
            self.rank // (self.tensor * self.context * self.dp_size) == 0


class ServiceDataset(IterableDataset):
    """This data-parallel rank's microbatches of a job (a DataClient made when iterated).

    ``config.dp_size`` must be the layout's (the service plans for that many ranks). ``state_dict``
    / ``load_state_dict`` save and restore the position (a torchdata StatefulDataLoader calls
    them); saving also acknowledges the saved step to the service, so it may drop the plans before
    it (``acknowledge=False`` to do that yourself with ``acknowledge()``)."""

    def __init__(self, address: str, config: JobConfig, layout: ParallelLayout | None = None, *,
                 acknowledge: bool = True, **client_options):
        super().__init__()
        layout = layout or ParallelLayout.from_torch()
        if config.dp_size != layout.dp_size:
            raise ValueError(f"the job plans for dp_size {config.dp_size}, the layout has {layout.dp_size} "
                             f"data-parallel ranks ({layout.world_size} processes / tensor {layout.tensor} x "
                             f"context {layout.context} x pipeline {layout.pipeline})")
        if not layout.reads_data:
            raise ValueError(f"rank {layout.rank} is not the rank of its data-parallel group that reads "
                             "(ParallelLayout.reads_data): it gets the group's batches from that rank")
        self.address, self.config, self.layout = address, config, layout
        self.auto_acknowledge = acknowledge
        self.client_options = client_options
        self._client: DataClient | None = None
        self._state: dict | None = None

    @property
    def client(self) -> DataClient:
        if self._client is None:
            self._client = DataClient(self.address, self.config, self.layout.dp_rank, **self.client_options)
            if self._state is not None:
                self._client.load_state_dict(self._state)
        return self._client

    def __iter__(self):
        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            raise ValueError("use num_workers=0 (or 1): the service decodes, and one stream serves one rank")
        for mb in self.client:  # noqa: UP028 (yield from would close the client when a loop breaks out)
            yield mb

    def state_dict(self) -> dict:
        """The position after the microbatches handed out so far; acknowledged to the service when
        it is a step boundary (the next step's first microbatch)."""
        state = self.client.state_dict()
        if self.auto_acknowledge and state["next_microbatch"] == 0 and state["next_step"] > 0:
            self.client.acknowledge(state["next_step"])
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume at a saved position (before iterating)."""
        if self._client is not None:
            self._client.load_state_dict(state)
        self._state = state

    def acknowledge(self, next_step: int | None = None) -> int:
        return self.client.acknowledge(next_step)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
