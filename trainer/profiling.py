"""Calibrate the service's cost model from your own trainer's timings.

The service prices every sequence (cost.py) to balance ranks and order microbatches; its default
coefficients are placeholders and ``disttrain calibrate`` measures a reference model on the
service's CPU node. ``CostProfiler`` measures the model you train, on your accelerators: it times
forward + backward of each microbatch for the first ``steps`` steps (after ``warmup`` steps) and
reports the times through the job's cost feedback (the job needs ``cost_feedback=True``). The
service refits its coefficients to them and prices the steps it plans afterwards with them. After
the profiling phase ``measure`` does nothing, so the loop pays for no synchronisation.

    profiler = CostProfiler(dataset.client, steps=8)
    for mb in loader:
        with profiler.measure(mb):
            loss = model(mb)
            loss.backward()
        ...
    print(profiler.last_ack)  # the coefficients the service now plans with

Timings are of the whole model (``report_totals``): the service fits the encoder, backbone and
generator terms jointly. Under DDP the last microbatch of a step also carries the gradient
all-reduce (and the wait for the slowest rank): the fit's error (``last_ack.total_rel_error``)
shows how much that matters for a model. A trainer that times each module (the disaggregated trainer,
``trainer/train.py --feedback``) sends them per module instead.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import grpc
import torch

from disttrain_api import preprocess_pb2 as pb
from disttrain_api.errors import ServiceUnavailableError
from trainer.client import DataClient, Microbatch

log = logging.getLogger(__name__)


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class CostProfiler:
    """Times microbatches of ``steps`` steps after ``warmup`` steps (the first ones pay for
    allocation and compilation) and reports them at the end of each step."""

    def __init__(self, client: DataClient, steps: int = 8, *, warmup: int = 1,
                 synchronize: Callable[[], None] = _synchronize):
        if steps < 1 or warmup < 0:
            raise ValueError(f"steps must be >= 1 and warmup >= 0 (got {steps}, {warmup})")
        if not client.info.spec.cost_feedback:
            raise ValueError(f"job {client.job_id} was opened without cost_feedback: open it with "
                             "JobConfig(cost_feedback=True) for the service to take your timings")
        self.client = client
        self.steps, self.warmup = steps, warmup
        self.synchronize = synchronize
        self.last_ack: pb.TimingAck | None = None
        """The service's answer to the last report: the coefficients it plans with from then on."""
        self._seen: set[int] = set()
        self._reported: set[int] = set()
        self._pending: list[tuple[int, int, float]] = []

    @property
    def active(self) -> bool:
        """Whether microbatches are still being timed."""
        return len(self._reported) < self.steps

    @contextlib.contextmanager
    def measure(self, mb: Microbatch) -> Iterator[None]:
        """Wraps one microbatch's forward and backward."""
        if not self.active:
            yield
            return
        self._seen.add(mb.step)
        if len(self._seen) <= self.warmup:
            yield
            return
        self.synchronize()
        start = time.perf_counter()
        yield
        self.synchronize()
        self._pending.append((mb.step, mb.microbatch_index, time.perf_counter() - start))
        if mb.microbatch_index + 1 == mb.num_microbatches:
            self.flush()
            self._reported.add(mb.step)

    def flush(self) -> pb.TimingAck | None:
        """Reports the timings measured since the last report (at each step's end, or call it)."""
        if not self._pending:
            return self.last_ack
        try:
            self.last_ack = self.client.report_totals(self._pending)
        except (grpc.RpcError, ServiceUnavailableError) as exc:  # the loop goes on; sent with the next report
            log.warning("cost profile of rank %d: the report failed (%s); kept for the next one", self.client.dp_rank,
                        exc)
            return self.last_ack
        self._pending = []
        if not self.active or len(self._reported) + 1 == self.steps:
            log.info("cost profile of rank %d: %d observations, fit error %.1f%%", self.client.dp_rank,
                     self.last_ack.num_observations, 100 * self.last_ack.total_rel_error)
        return self.last_ack
