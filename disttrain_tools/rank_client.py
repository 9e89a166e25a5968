"""The body of one client rank of ``run`` (runner.py): a separate process that iterates the
whole job with trainer.DataClient and reports what arrived. A module of its own, light on
imports: each rank process imports only this and the client, not the service, its shard readers
and media libraries, whose imports would cost every rank process CPU that a trainer's would not."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class RankResult:
    """What one client rank received."""

    rank: int
    microbatches: list[dict] = field(default_factory=list)
    """{"step", "microbatch", "keys"} of each microbatch, in arrival order."""
    num_sequences: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    data_wait_s: float = 0.0
    """Seconds the rank waited for its next microbatch (DataClient.data_wait_s)."""
    error: str = ""

    @property
    def keys(self) -> list[str]:
        """Delivered sample keys; in a mixture "DATASET/KEY" (datasets may reuse keys)."""
        return [key for mb in self.microbatches for key in mb["keys"]]



def consume_rank(address: str, job_id: str, rank: int, prefetch: int, results) -> None:
    """Body of one client process: iterate the whole job and report what arrived."""
    from trainer import DataClient  # imported in the child: torch loads once per rank process

    out = RankResult(rank=rank)
    start = time.perf_counter()
    try:
        with DataClient(address, job_id, rank, prefetch=prefetch) as client:
            names = [d.name for d in client.info.spec.datasets]
            for mb in client:
                keys = [f"{names[d]}/{k}" for d, k in zip(mb.sample_datasets, mb.sample_keys)] \
                    if mb.sample_datasets else mb.sample_keys
                out.microbatches.append({"step": mb.step, "microbatch": mb.microbatch_index, "keys": keys})
                out.num_sequences += int((mb.modality != 0).any(dim=1).sum())
                out.num_bytes += mb.nbytes
            out.data_wait_s = client.data_wait_s
    except Exception as exc:  # reported to the parent, which fails the run with it
        out.error = f"{type(exc).__name__}: {exc}"
    out.seconds = time.perf_counter() - start
    results.put(out)

