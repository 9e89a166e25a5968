"""One microbatch stream of one rank: a producer thread keeps two microbatches in the decode stage
(the decode pool shared by all streams) and puts finished, serialized messages into a bounded
queue; the gRPC handler's thread takes them from it. A slow client holds at most ``prefetch``
prepared microbatches of server memory; a cancelled or disconnected client stops the producer at
once. Messages are serialized by wire.encode_microbatch straight from the decode buffer (one copy),
charged to the memory budget before they exist and released when gRPC has taken them (or when
the stream has nothing to send while other charges wait for room: budget.py). A client on
this host that proves it shares /dev/shm is lent the decode buffer itself instead (decode/shm.py,
decode.Lent): no copy at all, a gRPC message of a few kilobytes, and no copy on its side (a
microbatch whose buffer cannot be lent, e.g. one with a failed document, is copied into a
shared-memory object of its own)."""

from __future__ import annotations

import collections
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from disttrain_api import preprocess_pb2 as pb
from disttrain_api import wire
from disttrain_api.errors import (
    ConfigError,
    DataQualityError,
    NotFoundError,
    PermissionDenied,
    ResourceExhausted,
    ServiceUnavailableError,
    StreamSuperseded,
)
from preprocess_service.adapters.decode import Decoder
from preprocess_service.adapters.decode.shm import SegmentLedger, same_host
from preprocess_service.adapters.infra import metrics
from preprocess_service.adapters.infra.budget import MemoryBudget, call_once
from preprocess_service.service.job import Job
from preprocess_service.service.security import StallWatchdog

log = logging.getLogger("preprocess_service.service.server")  # the stream's lines keep the server's logger
_END = object()


@dataclass(slots=True)
class StreamCounters:
    """Live numbers the tests and metrics read."""

    active_streams: int = 0
    prepared_microbatches: int = 0
    prepared_bytes: int = 0
    sent_microbatches: int = 0
    sent_bytes: int = 0


_STATUS_OF = ((NotFoundError, grpc.StatusCode.OUT_OF_RANGE), (StreamSuperseded, grpc.StatusCode.ABORTED),
              (DataQualityError, grpc.StatusCode.DATA_LOSS),
              (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
              (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
              (ServiceUnavailableError, grpc.StatusCode.UNAVAILABLE), (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
              # storage away (a network file system, an object store): the client tries again, maybe elsewhere
              (OSError, grpc.StatusCode.UNAVAILABLE))


def status_of(exc: BaseException) -> grpc.StatusCode:
    return next((code for kind, code in _STATUS_OF if isinstance(exc, kind)), grpc.StatusCode.INTERNAL)


def abort_rpc(context, exc: BaseException) -> None:
    """Ends the call with ``exc``'s status; a retry hint travels as grpc-retry-pushback-ms (the
    trailer gRPC's own retry policies read) and in the message."""
    retry_after = getattr(exc, "retry_after_s", None)
    message = str(exc)
    if retry_after is not None:
        context.set_trailing_metadata((("grpc-retry-pushback-ms", str(int(retry_after * 1000))),))
        message += f" (retry in {retry_after:g} s)"
    context.abort(status_of(exc), message)


@dataclass(slots=True)
class _Prepared:
    """A serialized microbatch waiting for gRPC, and how to return its memory-budget charge."""

    data: bytes
    release: Callable[[], None]
    nbytes: int
    """The microbatch's serialized size (len(data), or its shared-memory object's)."""


def _drain(items: queue.Queue) -> None:
    while True:
        try:
            item = items.get_nowait()
        except queue.Empty:
            return
        if isinstance(item, _Prepared):
            metrics.QUEUE_DEPTH.labels("send").dec()
            item.release()


def _has_media(pending) -> bool:
    return any(items for _, items in pending.layout.documents)


class MicrobatchStream:
    """Serves ``request`` (a StreamRequest) of ``job`` until the end, a failure, or ``stop``."""

    def __init__(self, job: Job, request, stop: threading.Event, *, decoder: Decoder, budget: MemoryBudget,
                 prefetch: int, watchdog: StallWatchdog, lag: metrics.StreamLag, count: Callable[..., None],
                 shm_delivery: bool = True):
        self.job, self.request, self.stop = job, request, stop
        self.decoder, self.budget, self.prefetch = decoder, budget, prefetch
        self.watchdog, self.lag, self._count = watchdog, lag, count
        self.shm_delivery = shm_delivery
        self.ledger: SegmentLedger | None = None
        """Set when this stream delivers in shared memory (decided in serve, from the call's peer)."""

    def serve(self, context):
        """Yields the serialized messages; aborts ``context`` with the status of a failure."""
        job, request, stop = self.job, self.request, self.stop
        if self.shm_delivery and same_host(context.peer(), request.shm_probe, request.shm_probe_token):
            # prepared ones in the queue, the one gRPC holds, and one in the client's hands
            self.ledger = SegmentLedger(self.budget, window=self.prefetch + 2,
                                        stall_timeout_s=self.watchdog.timeout_s)
            context.add_callback(self.ledger.close)  # however the call ends (a killed client too)
        items: queue.Queue = queue.Queue(maxsize=self.prefetch)
        producer = threading.Thread(target=self._produce, args=(job, request, items, stop),
                                    name=f"stream-{job.job_id}-r{request.dp_rank}", daemon=True)
        self._count(active_streams=1)
        metrics.ACTIVE_STREAMS.inc()
        producer.start()
        previous = None
        try:
            while True:
                try:
                    item = items.get(timeout=0.1)
                except queue.Empty:
                    if stop.is_set():  # cancelled or disconnected: the producer has stopped too
                        return
                    if previous is not None and self.budget.waiting:
                        # nothing to send while charges wait for room (this stream's next among them,
                        # maybe): the last message's charge goes back, else it would wait for itself.
                        # What gRPC still holds of it is resident, counted at the next memory sample.
                        previous.release()
                    continue
                if item is _END:
                    if self.ledger is not None:  # its last objects are still on their way to the client
                        self.ledger.wait_taken(lambda: stop.is_set() or not context.is_active())
                    return
                if isinstance(item, BaseException):
                    if self.ledger is not None:  # what was sent before the failure still reaches the client
                        self.ledger.wait_taken(lambda: stop.is_set() or not context.is_active())
                    code = status_of(item)
                    if code == grpc.StatusCode.INTERNAL:
                        log.error("stream failed", exc_info=item)
                        context.abort(code, f"microbatch preparation failed: {item!r}")
                    abort_rpc(context, item)
                metrics.QUEUE_DEPTH.labels("send").dec()
                self.watchdog.sending(id(stop), context, f"job {job.job_id} rank {request.dp_rank}")
                try:
                    yield item.data
                finally:
                    # gRPC has taken this message; its own copy of the previous one is gone now
                    if previous is not None:
                        previous.release()
                    previous = item
                self.watchdog.sent(id(stop))
                self._count(sent_microbatches=1, sent_bytes=item.nbytes)
        finally:
            stop.set()
            if previous is not None:
                previous.release()
            if self.ledger is not None:
                self.ledger.close()
            self.watchdog.sent(id(stop))
            self._count(active_streams=-1)
            metrics.ACTIVE_STREAMS.dec()
            _drain(items)  # prepared messages the client will never read (the producer drains too)

    def _produce(self, job: Job, request, items: queue.Queue, stop: threading.Event) -> None:
        """Waits for a microbatch's decoding once the next one is submitted: one decodes ahead of
        the one being serialized, so the workers stay busy while this stream finishes, lends and
        queues it. Unless other streams have work in the decode pool, which keeps the workers busy
        just as well: then the stream waits for each one it submits, and holds one arena in decode
        instead of two (bench/peers.py measures both: the same pace with several streams, less
        shared memory; a stream alone needs the one ahead to keep its pace). One with no media (the end of an epoch)
        takes no turn in the decode pool, so it does not count: the next is submitted at once,
        else it would join the pool's rounds a round late and the stream would get two
        microbatches at once, then wait two rounds."""
        in_decode: collections.deque = collections.deque()
        others_decoding = self.decoder.others_decoding
        lease = None
        try:
            lease = job.open_stream(request.dp_rank, request.start_step, stop)
            for plan, index, last in self._positions(job, request, stop):
                in_decode.append((plan, index, last,
                                  job.start_microbatch(plan, request.dp_rank, index, self.decoder, stop)))
                metrics.QUEUE_DEPTH.labels("decode").inc()
                held = 1 if others_decoding(stop) else 2
                while len(in_decode) > held or (len(in_decode) == held and _has_media(in_decode[-1][-1])):
                    if not self._emit(job, request, lease, in_decode.popleft(), items, stop):
                        return
            while in_decode and not stop.is_set():
                if not self._emit(job, request, lease, in_decode.popleft(), items, stop):
                    return
            if not stop.is_set():
                self._put(items, _END, stop)
        except BaseException as exc:  # handed to the consumer thread, which aborts the call with it
            self._put(items, exc, stop)
        finally:
            if lease is not None:
                lease.close()
            if stop.is_set():
                _drain(items)  # what it put after the consumer's last look
            for *_, pending in in_decode:  # abandoned by a cancelled stream: free the buffers
                pending.future.add_done_callback(lambda f: f.exception() or f.result().release())
            metrics.QUEUE_DEPTH.labels("decode").dec(len(in_decode))

    @staticmethod
    def _positions(job: Job, request, stop: threading.Event):
        """(plan, microbatch index, last of its step?) of every microbatch the stream sends."""
        step, end = request.start_step, (request.start_step + request.max_steps if request.max_steps else None)
        first = request.start_microbatch
        while (end is None or step < end) and not stop.is_set():
            plan = job.step_plan(step, stop)
            if plan is None:
                return
            for index in range(first, plan.num_microbatches):
                yield plan, index, index == plan.num_microbatches - 1
            step, first = step + 1, 0

    def _emit(self, job: Job, request, lease, entry, items: queue.Queue, stop: threading.Event) -> bool:
        plan, index, last, pending = entry
        metrics.QUEUE_DEPTH.labels("decode").dec()
        arrays, release, lend = job.finish_microbatch(pending)
        try:
            prepared = self._prepare(job, plan, request.dp_rank, index, arrays, stop, lend)
        finally:
            release()  # a no-op once lent
        if stop.is_set() or not self._put(items, prepared, stop):
            prepared.release()
            return False
        metrics.QUEUE_DEPTH.labels("send").inc()
        metrics.microbatch_sent(arrays, prepared.nbytes)
        if index == 0:
            metrics.step_planned(job.job_id, plan)
        if last:
            first = request.start_microbatch if plan.step == request.start_step else 0
            lease.step_sent(plan.step, plan.num_microbatches - first)
            self.lag.step_sent(job.job_id, request.dp_rank, plan.step)
            log.debug("step sent", extra={"job": job.job_id, "rank": request.dp_rank, "step": plan.step})
        for record in arrays.skipped:
            log.warning("skipped sample %s of %s: %s", record.key, record.shard, record.reason,
                        extra={"job": job.job_id, "rank": request.dp_rank, "step": plan.step})
        return True

    def _put(self, items: queue.Queue, item, stop: threading.Event) -> bool:
        while not stop.is_set():
            try:
                items.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _prepare(self, job: Job, plan, rank: int, index: int, arrays, stop: threading.Event,
                 lend=None) -> _Prepared:
        """The serialized message, charged to the memory budget before it exists (its tensors) and
        as it is (the header); the charge goes back when gRPC has taken it. A same-host client
        is lent the decode buffer itself where the decoder can (no copy: Microbatch.shm_token),
        else gets a copy in a shared-memory object of its own."""
        if self.ledger is not None and lend is not None:
            self.ledger.wait_for_room(stop)
            lent = lend(arrays.arrays)
            if lent is not None:
                self._count(prepared_microbatches=1, prepared_bytes=arrays.nbytes)
                header = self._header(job, plan, rank, index, arrays)
                header.shm_name, header.shm_nbytes, header.shm_token = lent.name, lent.nbytes, lent.token
                header.tensors.extend(pb.Tensor(name=name, dtype=wire.proto_dtype(dtype), shape=shape,
                                                shm_offset=offset) for name, dtype, shape, offset in lent.tensors)
                self.ledger.lend(lent, stop)
                job.note_message_bytes(lent.nbytes)
                return _Prepared(header.SerializeToString(), lambda: None, lent.nbytes)
        if self.ledger is not None:  # charged by the ledger until the client has taken it
            name, nbytes = self.ledger.write(self._message(job, plan, rank, index, arrays), stop)
            job.note_message_bytes(nbytes)
            return _Prepared(pb.Microbatch(shm_name=name, shm_nbytes=nbytes).SerializeToString(), lambda: None,
                             nbytes)
        self.budget.reserve(arrays.nbytes, what="a prepared microbatch", stop=stop)
        try:
            message = b"".join(self._message(job, plan, rank, index, arrays))
            extra = len(message) - arrays.nbytes
            self.budget.reserve(extra, what="a prepared microbatch", stop=stop)
        except BaseException:
            self.budget.release(arrays.nbytes)
            raise
        job.note_message_bytes(len(message))
        return _Prepared(message, call_once(lambda: self.budget.release(len(message))), len(message))

    def _message(self, job: Job, plan, rank: int, index: int, arrays) -> list:
        """The serialized Microbatch as pieces (wire.encoded_parts): views of the arrays, not copies."""
        self._count(prepared_microbatches=1, prepared_bytes=arrays.nbytes)
        return wire.encoded_parts(self._header(job, plan, rank, index, arrays), arrays.arrays)

    @staticmethod
    def _header(job: Job, plan, rank: int, index: int, arrays) -> pb.Microbatch:
        """The Microbatch without its tensors."""
        return pb.Microbatch(
            job_id=job.job_id, step=plan.step, epoch=plan.epoch, dp_rank=rank, microbatch_index=index,
            num_microbatches=plan.num_microbatches, sample_keys=arrays.sample_keys,
            sample_datasets=arrays.sample_datasets if job.config.datasets else [],
            sequence_costs=[pb.SequenceCost(encoder_s=s.cost.encoder_s, backbone_s=s.cost.backbone_s,
                                            generator_s=s.cost.generator_s, total_s=s.cost.total_s)
                            for s in plan.microbatch(rank, index)],
            skipped=[pb.SkippedSample(key=r.key, shard=r.shard, reason=r.reason, kind=r.kind) for r in arrays.skipped],
        )
