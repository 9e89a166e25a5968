"""gRPC adapter: the Preprocess servicer, health checking, reflection, and create_server().

Servicer methods convert proto -> domain objects, call the job, and map domain errors to status
codes. Every stream has one producer thread that prepares microbatches into a bounded queue, so
a slow client holds at most ``prefetch`` prepared microbatches of server memory, and a cancelled
or disconnected client stops its producer at once.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from disttrain_api import preprocess_pb2 as pb
from disttrain_api import preprocess_pb2_grpc as pb_grpc
from preprocess_service import wire
from preprocess_service.errors import ConfigError, NotFoundError
from preprocess_service.job import Job, JobRegistry
from preprocess_service.spec import config_from_spec, spec_from_config

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Preprocess"].full_name
MAX_MESSAGE_BYTES = 1 << 30
"""Both directions; a microbatch of 8 x 8192 tokens of 1024-token images is ~150 MiB."""
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
_END = object()


@dataclass(slots=True)
class StreamCounters:
    """Live numbers the tests and metrics read."""

    active_streams: int = 0
    prepared_microbatches: int = 0
    prepared_bytes: int = 0
    sent_microbatches: int = 0
    sent_bytes: int = 0


class PreprocessServicer(pb_grpc.PreprocessServicer):
    def __init__(self, *, prefetch: int = 2, decode_threads: int | None = None):
        self.jobs = JobRegistry()
        self.prefetch = prefetch
        # Shared by all streams: one stream alone can use every core, many streams share them.
        self.decode_pool = futures.ThreadPoolExecutor(max_workers=decode_threads or os.cpu_count() or 1,
                                                      thread_name_prefix="decode")
        self.counters = StreamCounters()
        self._counter_lock = threading.Lock()

    def _job(self, job_id: str, context) -> Job:
        try:
            return self.jobs.get(job_id)
        except NotFoundError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))

    def _info(self, job: Job) -> pb.JobInfo:
        return pb.JobInfo(job_id=job.job_id, spec=spec_from_config(job.config),
                          global_batch_sequences=job.config.global_batch, num_steps=job.num_steps(),
                          shard_urls=job.shard_urls)

    def OpenJob(self, request, context):
        try:
            job = self.jobs.open(config_from_spec(request.spec))
        except ConfigError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return self._info(job)

    def DescribeJob(self, request, context):
        return self._info(self._job(request.job_id, context))

    def Acknowledge(self, request, context):
        job = self._job(request.job_id, context)
        try:
            return pb.AckResponse(min_next_step=job.acknowledge(request.dp_rank, request.next_step))
        except ConfigError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def GetReport(self, request, context):
        job = self._job(request.job_id, context)
        report = job.report()
        skipped = [pb.SkippedSample(key=r.key, shard=r.shard, reason=r.reason, kind=r.kind)
                   for r in report.pop("skipped")]
        balance = [pb.StepBalance(**b) for b in report.pop("step_balance")]
        return pb.JobReport(job_id=job.job_id, skipped=skipped, step_balance=balance, **report)

    def StreamMicrobatches(self, request, context):
        job = self._job(request.job_id, context)
        try:
            job.check_rank(request.dp_rank)
        except ConfigError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.start_step > 0 and job.step_plan(request.start_step - 1) is None:
            context.abort(grpc.StatusCode.OUT_OF_RANGE,
                          f"start_step {request.start_step} is past the job's last step "
                          f"({job.num_steps() - 1})")
        stop = threading.Event()
        context.add_callback(stop.set)
        items: queue.Queue = queue.Queue(maxsize=self.prefetch)
        producer = threading.Thread(target=self._produce, args=(job, request, items, stop),
                                    name=f"stream-{job.job_id}-r{request.dp_rank}", daemon=True)
        self._count(active_streams=1)
        producer.start()
        try:
            while True:
                try:
                    item = items.get(timeout=0.1)
                except queue.Empty:
                    if stop.is_set():  # cancelled or disconnected: the producer has stopped too
                        return
                    continue
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    log.exception("stream failed", exc_info=item)
                    context.abort(grpc.StatusCode.INTERNAL, f"microbatch preparation failed: {item!r}")
                yield item
                self._count(sent_microbatches=1, sent_bytes=item.ByteSize())
        finally:
            stop.set()
            self._count(active_streams=-1)

    def _produce(self, job: Job, request, items: queue.Queue, stop: threading.Event) -> None:
        try:
            step, end = request.start_step, (request.start_step + request.max_steps if request.max_steps else None)
            first = request.start_microbatch
            while (end is None or step < end) and not stop.is_set():
                plan = job.step_plan(step)
                if plan is None:
                    break
                for index in range(first, plan.num_microbatches):
                    if stop.is_set() or not self._put(items, self._message(job, plan, request.dp_rank, index), stop):
                        return
                job.mark_sent(request.dp_rank, step, plan.num_microbatches - first)
                step, first = step + 1, 0
            self._put(items, _END, stop)
        except BaseException as exc:  # handed to the consumer thread, which aborts the call with it
            self._put(items, exc, stop)

    def _put(self, items: queue.Queue, item, stop: threading.Event) -> bool:
        while not stop.is_set():
            try:
                items.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _message(self, job: Job, plan, rank: int, index: int) -> pb.Microbatch:
        arrays = job.microbatch(plan, rank, index, map_fn=self.decode_pool.map)
        self._count(prepared_microbatches=1, prepared_bytes=arrays.nbytes)
        return pb.Microbatch(
            job_id=job.job_id, step=plan.step, epoch=plan.epoch, dp_rank=rank, microbatch_index=index,
            num_microbatches=plan.num_microbatches,
            tensors=[wire.to_tensor(name, array) for name, array in arrays.arrays.items()],
            sample_keys=arrays.sample_keys,
            sequence_costs=[pb.SequenceCost(encoder_s=s.cost.encoder_s, backbone_s=s.cost.backbone_s,
                                            generator_s=s.cost.generator_s, total_s=s.cost.total_s)
                            for s in plan.microbatch(rank, index)],
            skipped=[pb.SkippedSample(key=k, shard=s, reason=r, kind="decode_failed") for k, s, r in arrays.skipped],
        )

    def _count(self, **deltas: int) -> None:
        with self._counter_lock:
            for name, delta in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + delta)


def create_server(address: str = "[::]:0", *, max_workers: int = 32, prefetch: int = 2,
                  decode_threads: int | None = None):
    """Builds and starts a server; returns (server, bound port, servicer). ``decode_threads``
    defaults to the number of cores. The planner's compiled kernels are loaded first, so health
    checks report SERVING only once a step can be planned at full speed."""
    from preprocess_service.reorder import ours

    ours.warm_up()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=CHANNEL_OPTIONS)
    servicer = PreprocessServicer(prefetch=prefetch, decode_threads=decode_threads)
    pb_grpc.add_PreprocessServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise ConfigError(f"cannot bind the service to {address!r}")
    server.start()
    return server, port, servicer
