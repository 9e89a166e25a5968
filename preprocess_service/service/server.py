"""gRPC adapter: the Preprocess servicer, health checking, reflection, and create_server().

Servicer methods convert proto -> domain objects, call the job, and map domain errors to status
codes; a stream's admission (memory commitment, per-client limit, the first plan) is checked
here and the stream itself is served by streams.MicrobatchStream.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time

import grpc
from grpc_health.v1 import health_pb2

from disttrain_api import heap
from disttrain_api import preprocess_pb2 as pb
from disttrain_api import preprocess_pb2_grpc as pb_grpc
from disttrain_api.channel import SERVICE_NAME
from disttrain_api.errors import (
    ConfigError,
    DataQualityError,
    FeedbackDisabled,
    JobClosedError,
    NotFoundError,
    PermissionDenied,
    ResourceExhausted,
    ServiceUnavailableError,
)
from disttrain_api.spec import config_from_spec, spec_from_config
from preprocess_service.adapters.decode import MAX_START_FAILURES, DecodePool, InlineDecoder, shm
from preprocess_service.adapters.infra import metrics, procmem
from preprocess_service.adapters.infra.budget import MemoryBudget
from preprocess_service.adapters.io.shards import ShardReader
from preprocess_service.adapters.plugins.hooks import HookLimits
from preprocess_service.core.reorder import PLANNERS
from preprocess_service.service.documents import expand_datasets
from preprocess_service.service.front import SERVER_KEEPALIVE_OPTIONS, Front  # noqa: F401 (re-exported)
from preprocess_service.service.job import Job, JobRegistry
from preprocess_service.service.security import (
    StallWatchdog,
    StreamLimiter,
    TlsFiles,
    client_identity,
)
from preprocess_service.service.settings import ServiceSettings
from preprocess_service.service.streams import MicrobatchStream, StreamCounters, abort_rpc, status_of

log = logging.getLogger(__name__)
MAX_LISTED_SHARDS = 100_000
"""JobInfo lists at most this many shard URLs (every rank asks for it; a million would be ~30 MB)."""





DEFAULTS = ServiceSettings()


MAX_TIMINGS_PER_REPORT = 65_536
MAX_TIMING_S = 86_400.0
"""A measured microbatch time above a day is not a measurement."""
MIN_TIMING_S = 1e-6
"""A timing above 0 but below this is no measurement (and would weigh a fit without bound)."""


def check_timings(request) -> None:
    """ConfigError naming the first field of a TimingReport outside its documented range."""
    if len(request.timings) > MAX_TIMINGS_PER_REPORT:
        raise ConfigError(f"a TimingReport holds {len(request.timings)} timings, more than {MAX_TIMINGS_PER_REPORT}")
    for i, t in enumerate(request.timings):
        for name in ("encoder_s", "backbone_s", "generator_s", "total_s"):
            value = getattr(t, name)
            if not (math.isfinite(value) and 0.0 <= value <= MAX_TIMING_S):
                raise ConfigError(f"timings[{i}].{name} = {value!r} is not a finite number of seconds in "
                                  f"[0, {MAX_TIMING_S:g}]")
        for name in ("encoder_s", "backbone_s", "generator_s", "total_s"):
            if 0.0 < getattr(t, name) < MIN_TIMING_S:
                raise ConfigError(f"timings[{i}].{name} = {getattr(t, name)!r} is below {MIN_TIMING_S:g} s: not a "
                                  "measurement (0 means not timed)")
        if t.total_s and (t.encoder_s or t.backbone_s or t.generator_s):
            raise ConfigError(f"timings[{i}] has total_s and module seconds: give the modules' seconds, or "
                              "total_s alone for a model not timed per module")
    if request.has_bubble and not (math.isfinite(request.bubble_fraction) and 0.0 <= request.bubble_fraction <= 1.0):
        raise ConfigError(f"bubble_fraction = {request.bubble_fraction!r} is not a fraction in [0, 1]")


class PreprocessServicer(pb_grpc.PreprocessServicer):
    def __init__(self, *, decoder, prefetch: int = 2, jobs: JobRegistry | None = None,
                 settings: ServiceSettings = DEFAULTS, authenticated: bool = False, reader: ShardReader | None = None):
        self.jobs = jobs or JobRegistry()
        self.settings = settings
        self.authenticated = authenticated
        """Token auth is on: a client's identity is its token, and a job belongs to the one that opened it."""
        self.reader = reader or ShardReader.configured(settings)
        """Shared by every job of this server (and its cache of remote shards)."""
        self.budget = self.jobs.budget
        self.streams = StreamLimiter(settings.max_streams_per_client)
        self.watchdog = StallWatchdog(settings.stream_stall_timeout_s)
        self.lag = metrics.StreamLag()
        self.prefetch = prefetch
        self.decoder = decoder
        """Shared by all streams: one stream alone can use every worker, many streams share them."""
        self.counters = StreamCounters()
        self._counter_lock = threading.Lock()

    def _identity(self, context) -> str:
        return client_identity(context, authenticated=self.authenticated)

    def _job(self, job_id: str, context) -> Job:
        """The job, if this caller may use it: with token auth, only its owner's token may."""
        try:
            job = self.jobs.get(job_id)
        except JobClosedError as exc:  # closed on purpose: a client must not open it again by itself
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except NotFoundError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except ServiceUnavailableError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        self._check_access(job, self._identity(context), context)
        return job

    def _check_access(self, job: Job, client: str, context) -> None:
        if self.authenticated and job.owner and client != job.owner:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"job {job.job_id} belongs to another client's token; open your own job")

    def _member(self, job: Job, context) -> None:
        """Only a client that opened or joined the job changes it (timings, closing)."""
        client = self._identity(context)
        if job.clients and client not in job.clients:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"{client} has not opened job {job.job_id}; only its clients may change it (OpenJob first)")

    def _info(self, job: Job) -> pb.JobInfo:
        return pb.JobInfo(job_id=job.job_id, spec=spec_from_config(job.config),
                          global_batch_sequences=job.config.global_batch, num_steps=job.num_steps(),
                          shard_urls=job.listed_shards(MAX_LISTED_SHARDS), num_shards=len(job.shard_urls),
                          tokenizer=pb.TokenizerInfo(**job.tokenizer_info))

    def OpenJob(self, request, context):
        try:
            config = config_from_spec(request.spec)
            self._check_config(config)
            # parsed, expanded (bounded) and checked here, outside every lock: a bad spec is refused as
            # such whatever the server's load
            shard_urls = None if self.jobs.is_open(config.job_id()) else expand_datasets(self.reader, config)
            client = self._identity(context)
            if not self.jobs.is_open(config.job_id()):
                self._check_job_limits(client, config)
            if request.continue_at_step:
                job = self.jobs.continue_lineage(config, int(request.continue_at_step), client,
                                                 shard_urls=shard_urls, reader=self.reader)
            else:
                job = self.jobs.open(config, shard_urls=shard_urls, reader=self.reader, client=client)
        except (ConfigError, ServiceUnavailableError, PermissionDenied, ResourceExhausted, NotFoundError) as exc:
            abort_rpc(context, exc)
        self._check_access(job, client, context)
        return self._info(job)

    def _check_config(self, config) -> None:
        """The server's own bounds, on top of the ones every JobConfig checks, and a planner it has."""
        if config.reorder_algorithm not in PLANNERS:
            raise ConfigError(f"unknown reorder_algorithm {config.reorder_algorithm!r}; this server has "
                              f"{sorted(PLANNERS)}")
        if config.seq_len > self.settings.max_seq_len:
            raise ConfigError(f"seq_len {config.seq_len} is more than this server's "
                              f"max_seq_len {self.settings.max_seq_len}")
        bound = config.max_microbatch_bytes()
        if bound > self.settings.max_microbatch_bytes:
            raise ConfigError(f"a microbatch of this job may hold up to {bound} bytes (seqs_per_microbatch x seq_len "
                              f"x the costliest token), more than this server's max_microbatch_bytes "
                              f"{self.settings.max_microbatch_bytes}; "
                              "lower seq_len, seqs_per_microbatch or the media sizes")

    def _check_job_limits(self, client: str, config) -> None:
        self.budget.admit(2 * config.max_microbatch_bytes(), "a new job")
        limit, per_client = self.settings.max_open_jobs, self.settings.max_open_jobs_per_client
        if limit and self.jobs.num_open() >= limit:
            raise ResourceExhausted(f"{self.jobs.num_open()} jobs are open on this server, the most it allows "
                                    f"(max_open_jobs); close one (CloseJob) or wait for idle ones to expire "
                                    f"(job_idle_ttl_s {self.settings.job_idle_ttl_s:g} s)",
                                    retry_after_s=min(60.0, self.settings.job_idle_ttl_s))
        if per_client and self.jobs.num_owned(client) >= per_client:
            raise ResourceExhausted(f"{client} already has {self.jobs.num_owned(client)} open jobs, the most one "
                                    f"client may (max_open_jobs_per_client); close one (CloseJob)",
                                    retry_after_s=min(60.0, self.settings.job_idle_ttl_s))

    def DescribeJob(self, request, context):
        job = self._job(request.job_id, context)
        job.clients.add(self._identity(context))  # joined by id
        return self._info(job)

    def CloseJob(self, request, context):
        job = self._job(request.job_id, context)
        self._member(job, context)
        try:
            ended = self.jobs.close_job(job.job_id)
        except NotFoundError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        log.info("job closed by %s; %d stream(s) ended", self._identity(context), ended, extra={"job": job.job_id})
        return pb.CloseJobResponse(num_streams_closed=ended)

    def ListJobs(self, request, context):
        client = self._identity(context)
        jobs = [job for job in self.jobs.open_jobs() if not (self.authenticated and job.owner and job.owner != client)]
        return pb.ListJobsResponse(jobs=[pb.JobSummary(**job.summary()) for job in jobs])

    def Acknowledge(self, request, context):
        job = self._job(request.job_id, context)
        try:
            return pb.AckResponse(min_next_step=job.acknowledge(request.dp_rank, request.next_step))
        except (ConfigError, ServiceUnavailableError) as exc:
            context.abort(status_of(exc), str(exc))

    def GetReport(self, request, context):
        job = self._job(request.job_id, context)
        try:
            report = job.report()
        except ServiceUnavailableError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        skipped = [pb.SkippedSample(key=r.key, shard=r.shard, reason=r.reason, kind=r.kind)
                   for r in report.pop("skipped")]
        balance = [pb.StepBalance(**b) for b in report.pop("step_balance")]
        datasets = [pb.DatasetCount(**d) for d in report.pop("datasets", [])]
        plugins = [pb.PluginCost(**c) for c in report.pop("plugins", [])]
        return pb.JobReport(job_id=job.job_id, skipped=skipped, step_balance=balance, datasets=datasets,
                            plugins=plugins, **report)

    def ReportTimings(self, request, context):
        job = self._job(request.job_id, context)
        self._member(job, context)
        try:
            check_timings(request)
            for t in request.timings:
                job.check_rank(t.dp_rank)
        except ConfigError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        timings = [(t.step, t.dp_rank, t.microbatch_index, t.encoder_s, t.backbone_s, t.generator_s, t.total_s)
                   for t in request.timings]
        try:
            result = job.report_timings(timings)
        except FeedbackDisabled as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ServiceUnavailableError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        if request.has_bubble:
            metrics.bubble_measured(job.job_id, request.bubble_fraction)
        errors = result["errors"]
        return pb.TimingAck(cost=pb.CostSpec(**dataclasses.asdict(result["cost"])),
                            num_observations=result["num_observations"],
                            first_step_priced=result["first_step_priced"],
                            encoder_rel_error=errors.get("encoder", 0.0),
                            backbone_rel_error=errors.get("backbone", 0.0),
                            generator_rel_error=errors.get("generator", 0.0),
                            total_rel_error=errors.get("total", 0.0))

    def StreamMicrobatches(self, request, context):
        job = self._job(request.job_id, context)
        try:
            job.check_rank(request.dp_rank)
        except ConfigError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        client = self._identity(context)
        try:
            end_commitment = self.budget.commit(job.stream_estimate(self.prefetch, request.start_step, request.dp_rank),
                                              f"a stream of job {job.job_id}")
        except ResourceExhausted as exc:
            abort_rpc(context, exc)
        try:
            self.streams.acquire(client)
        except ResourceExhausted as exc:
            end_commitment()
            abort_rpc(context, exc)
        context_fields = {"job": job.job_id, "rank": request.dp_rank, "step": request.start_step}
        log.info("stream opened by %s at step %d microbatch %d", client, request.start_step,
                 request.start_microbatch, extra=context_fields)
        try:
            yield from self._stream(job, request, context)
        finally:
            end_commitment()
            self.streams.release(client)
            log.info("stream closed", extra=context_fields)

    def _stream(self, job: Job, request, context):
        stop = threading.Event()
        context.add_callback(stop.set)
        job.add_stream(stop)
        try:
            yield from self._stream_job(job, request, context, stop)
        finally:
            job.remove_stream(stop)
        if job.closed.is_set() and context.is_active():
            context.abort(grpc.StatusCode.CANCELLED, f"job {job.job_id} was closed (CloseJob or idle expiry)")

    def _stream_job(self, job: Job, request, context, stop: threading.Event):
        try:
            past_end = job.step_plan(request.start_step, stop) is None and request.start_step > job.num_steps()
        except (NotFoundError, ServiceUnavailableError, DataQualityError) as exc:
            context.abort(status_of(exc), str(exc))
        except Exception as exc:  # a planning bug: INTERNAL, with the cause
            log.error("planning failed", exc_info=exc, extra={"job": job.job_id})
            context.abort(grpc.StatusCode.INTERNAL, f"planning failed: {exc!r}")
        if past_end:
            context.abort(grpc.StatusCode.OUT_OF_RANGE,
                          f"start_step {request.start_step} is past the job's last step "
                          f"({job.num_steps() - 1})")
        yield from MicrobatchStream(job, request, stop, decoder=self.decoder, budget=self.budget,
                                    prefetch=self.prefetch, watchdog=self.watchdog, lag=self.lag,
                                    count=self._count, shm_delivery=self.settings.shm_delivery).serve(context)

    def _count(self, **deltas: int) -> None:
        with self._counter_lock:
            for name, delta in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + delta)


def _handlers(servicer: PreprocessServicer) -> dict[str, grpc.RpcMethodHandler]:
    """The Preprocess service's method handlers, by name: as the generated
    add_PreprocessServicer_to_server's, except that StreamMicrobatches yields messages already
    serialized by disttrain_api.wire.encode_microbatch."""
    handlers = {
        "OpenJob": grpc.unary_unary_rpc_method_handler(
            servicer.OpenJob, pb.OpenJobRequest.FromString, pb.JobInfo.SerializeToString),
        "DescribeJob": grpc.unary_unary_rpc_method_handler(
            servicer.DescribeJob, pb.DescribeJobRequest.FromString, pb.JobInfo.SerializeToString),
        "StreamMicrobatches": grpc.unary_stream_rpc_method_handler(
            servicer.StreamMicrobatches, pb.StreamRequest.FromString, None),
        "Acknowledge": grpc.unary_unary_rpc_method_handler(
            servicer.Acknowledge, pb.AckRequest.FromString, pb.AckResponse.SerializeToString),
        "GetReport": grpc.unary_unary_rpc_method_handler(
            servicer.GetReport, pb.ReportRequest.FromString, pb.JobReport.SerializeToString),
        "ReportTimings": grpc.unary_unary_rpc_method_handler(
            servicer.ReportTimings, pb.TimingReport.FromString, pb.TimingAck.SerializeToString),
        "CloseJob": grpc.unary_unary_rpc_method_handler(
            servicer.CloseJob, pb.CloseJobRequest.FromString, pb.CloseJobResponse.SerializeToString),
        "ListJobs": grpc.unary_unary_rpc_method_handler(
            servicer.ListJobs, pb.ListJobsRequest.FromString, pb.ListJobsResponse.SerializeToString),
    }
    missing = set(pb.DESCRIPTOR.services_by_name["Preprocess"].methods_by_name) - set(handlers)
    assert not missing, f"rpcs without a handler: {missing}"
    return handlers


def _housekeeping(jobs: JobRegistry, idle_ttl_s: float, stop: threading.Event) -> None:
    """Closes jobs nobody used for ``idle_ttl_s`` (abandoned by a crashed or finished trainer), and
    every few seconds hands the heap memory freed meanwhile back to the system."""
    interval = min(5.0, max(0.05, idle_ttl_s / 4))
    last_expiry = time.monotonic()
    while not stop.wait(interval):
        heap.trim_malloc()
        if time.monotonic() - last_expiry < min(30.0, idle_ttl_s / 4):
            continue
        last_expiry = time.monotonic()
        for job_id in jobs.expire(idle_ttl_s):
            log.info("job expired after %g s without a stream or call; freed", idle_ttl_s, extra={"job": job_id})


def _own_baseline(budget: MemoryBudget) -> int | None:
    """Records this idle process's memory as the budget's baseline (ConfigError if the budget leaves
    too little above it) and returns it; None (a warning) where /proc cannot be read. The decode
    workers are added once they are up (_warm_up)."""
    import os

    own = procmem.pss_bytes([os.getpid()])
    if own is None:
        log.warning("cannot read this platform's process memory: the memory budget counts its charges only")
        return None
    budget.set_baseline(own)
    budget.on_pressure = heap.trim_malloc
    return own


def _trim_all(pool: DecodePool):
    """The budget's pressure callback: the server and its decode workers give freed heap back."""
    def trim() -> None:
        heap.trim_malloc()
        pool.trim_workers()
    return trim


def _warm_up(decoder, budget: MemoryBudget, settings: ServiceSettings, own: int | None, front: Front,
             jobs: JobRegistry, warmed: threading.Event, stop: threading.Event) -> None:
    """After the server started, on a daemon thread: loads the planner's compiled kernels, waits for
    the decode workers, adds their idle memory to the budget's baseline (a budget that leaves too
    little then is logged and the server reports NOT_SERVING), then feeds the budget a memory
    sample every ``settings.memory_sample_s`` (procmem.py) until ``stop``. Requests are served
    meanwhile: a job's first step is planned and decoded as the kernels and workers come up.
    ``warmed`` is set once that is done, or has failed."""
    try:
        own = _warm(decoder, budget, settings, own, front, jobs)
    finally:
        warmed.set()
    _sample_memory(decoder, budget, settings, own, stop)


def _warm(decoder, budget: MemoryBudget, settings: ServiceSettings, own: int | None, front: Front,
          jobs: JobRegistry) -> int | None:
    """The background start-up; returns the server process's idle memory (the kernels included
    when it could be measured before any job was opened)."""
    import os

    from preprocess_service.core.reorder import ours

    started = time.monotonic()
    if settings.warm_up:
        ours.warm_up()
        if own is not None and jobs.num_open() == 0:  # else its data would count as idle
            own = max(own, procmem.pss_bytes([os.getpid()]) or 0)
    if isinstance(decoder, DecodePool):
        try:
            decoder.wait_ready(MAX_START_FAILURES * (decoder.start_timeout_s + 10))
        except RuntimeError as exc:  # its waiting work fails with the same error
            log.error("decode workers cannot start: %s", exc)
            _not_serving(front)
            return own
    log.info("warm in %.2f s: planner kernels loaded, decode workers up", time.monotonic() - started)
    workers = decoder.idle_memory() if isinstance(decoder, DecodePool) else 0
    if own is not None and settings.memory_sample_s > 0:
        try:
            budget.set_baseline(own + (workers or 0) + _helpers_memory(decoder))
        except ConfigError as exc:
            log.error("%s", exc)
            _not_serving(front)
            return own
    front.warm()
    return own


def _helpers_memory(decoder) -> int:
    """The idle memory of this process's other descendants: the fork server the decode workers
    fork from and multiprocessing's resource tracker. They hold no data, but they are part of the
    service the budget bounds."""
    import os

    workers = set(decoder.worker_pids()) if isinstance(decoder, DecodePool) else set()
    helpers = [pid for pid in procmem.descendants(os.getpid()) if pid not in workers]
    return procmem.pss_bytes(helpers) or 0


def _not_serving(front: Front) -> None:
    front.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    front.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)


TRIM_ABOVE_BYTES = 32 << 20
"""Free heap the server gives back at its next memory sample (heap.trim_malloc). tune_malloc keeps
freed memory for reuse, but the shard readers' encoded bytes come and go in pieces that fragment
the heap, which trimming gives back (bench/peers.py shows the server's peak; docs/benchmarks.md)."""


def _sample_memory(decoder, budget: MemoryBudget, settings: ServiceSettings, own: int | None,
                   stop: threading.Event) -> None:
    """Feeds the budget a sample of the service's memory (this process and all its descendants:
    decode workers, fork server, resource tracker) every ``settings.memory_sample_s`` until ``stop``,
    giving the heap's free memory back first when it passes TRIM_ABOVE_BYTES."""
    import os

    if own is None or settings.memory_sample_s <= 0:
        return
    measure = procmem.Calibrated(lambda: [os.getpid(), *procmem.descendants(os.getpid())])
    while not stop.wait(settings.memory_sample_s):
        free = heap.free_heap_bytes()
        if free is not None and free > TRIM_ABOVE_BYTES:
            heap.trim_malloc()
        resident = measure()
        if resident is not None:
            budget.observe(resident)


def create_decoder(decode_workers: int | None, budget: MemoryBudget | None = None, *, wait: bool = True):
    """The decode stage: a pool of ``decode_workers`` processes (None: one per CPU of the quota), or decoding
    on threads in this process for 0; its buffers are charged to ``budget``. ``wait=False``
    returns while the pool's workers start (DecodePool.wait_ready)."""
    from preprocess_service.adapters.infra.budget import UNLIMITED

    budget = budget or UNLIMITED
    if decode_workers == 0:
        from preprocess_service.adapters.infra.cpus import available_cpus

        return InlineDecoder(num_threads=available_cpus(), budget=budget)
    return DecodePool(decode_workers, budget=budget, wait=wait)


def start_front(address: str, settings: ServiceSettings = DEFAULTS, *, tls: TlsFiles | None = None) -> Front:
    """The service's port, bound and answering health (NOT_SERVING until create_server attaches the
    service): what ``serve`` starts first, before it imports the rest (front.py)."""
    return Front(address, max_workers=settings.max_workers, max_request_bytes=settings.max_request_bytes,
                 tokens=settings.tokens(), tls=tls)


def create_server(address: str = "[::]:0", settings: ServiceSettings = DEFAULTS, *, tls: TlsFiles | None = None,
                  job_options: dict | None = None, front: Front | None = None, **overrides):
    """Builds and starts a server; returns (server, bound port, servicer). ``settings`` (settings.py:
    every setting the ``serve`` command takes, each documented there), with ``overrides`` of any of
    them by name (``decode_workers=0``, ``redis_url=...``, ``memory_budget_bytes=...``).

    It serves at once: the decode workers start and the planner's compiled kernels load in the
    background (``server.wait_warm()`` waits for both), while the first jobs are opened and
    planned; their first decoding waits for a ready worker. ``server.stop()`` also stops the
    decode workers. With ``redis_url`` the server is one replica of a deployment (shared_job.py);
    ``job_options`` go to every job's SharedPlans (lookahead, lease_ttl_s, ...). Raises
    ServiceUnavailableError, naming the address, if Redis cannot be reached. ``tls`` serves TLS
    (mutual TLS with a client CA). ``front`` is the port start_front already bound (``address``,
    ``tls`` and the gRPC settings were its); without it one is bound here."""
    settings = dataclasses.replace(settings, **overrides) if overrides else settings
    budget = MemoryBudget.configured(settings)
    metrics.watch_budget(budget)
    decoder = create_decoder(settings.decode_workers, budget, wait=False)  # workers start while the rest is set up
    shm.sweep_orphans()  # same-host microbatches a killed server left in /dev/shm
    own_front = front is None
    try:
        if front is None:
            front = start_front(address, settings, tls=tls)
        return _serve(decoder, budget, front, settings, job_options=job_options)
    except BaseException:
        decoder.close()
        if own_front and front is not None:
            front.server.stop(0)
        raise


def _serve(decoder, budget: MemoryBudget, front: Front, settings: ServiceSettings, *, job_options: dict | None):
    plugin_limits = HookLimits(time_s=settings.plugin_timeout_s, memory_bytes=settings.plugin_memory_mb << 20)
    jobs = JobRegistry(budget, state_dir=settings.state_dir, plugin_limits=plugin_limits)
    reader = ShardReader.configured(settings)
    auth_tokens = settings.tokens()
    if settings.redis_url:
        import os
        import socket

        from preprocess_service.adapters.infra.store import RedisStore
        from preprocess_service.service.shared_job import shared_registry

        store = RedisStore(settings.redis_url)
        replica_id = settings.replica_id or f"{socket.gethostname()}:{front.port}:{os.getpid()}"
        jobs = shared_registry(store, replica_id, reader=reader, budget=budget, plugin_limits=plugin_limits,
                               stream_timeout_s=settings.stream_redis_timeout_s,
                               **{"lease_ttl_s": settings.lease_ttl_s, **(job_options or {})})
    jobs.plan_ahead = settings.plan_ahead
    heap.tune_malloc()
    heap.limit_malloc_arenas()
    reaper_stop = threading.Event()
    own = None
    if settings.memory_sample_s > 0:
        try:
            own = _own_baseline(budget)
            if isinstance(decoder, DecodePool):
                budget.on_pressure = _trim_all(decoder)
        except ConfigError:
            jobs.close()
            raise
    servicer = PreprocessServicer(prefetch=settings.prefetch, decoder=decoder, jobs=jobs, settings=settings,
                                  authenticated=bool(auth_tokens), reader=reader)
    threading.Thread(target=_housekeeping, args=(jobs, settings.job_idle_ttl_s, reaper_stop), daemon=True,
                     name="housekeeping").start()
    front.attach(_handlers(servicer))
    warmed = threading.Event()
    threading.Thread(target=_warm_up, args=(decoder, budget, settings, own, front, jobs, warmed, reaper_stop),
                     daemon=True, name="warm-up").start()
    return (Service(front.server, decoder=decoder, jobs=jobs, servicer=servicer, background_stop=reaper_stop,
                    warmed=warmed), front.port, servicer)


class Service:
    """A running service: the gRPC server and what it owns (decode workers, jobs, housekeeping and
    memory threads). ``stop()`` ends all of them; every other attribute is the gRPC server's."""

    def __init__(self, server: grpc.Server, *, decoder, jobs: JobRegistry, servicer: PreprocessServicer,
                 background_stop: threading.Event, warmed: threading.Event):
        self._server, self._decoder, self._jobs, self._servicer = server, decoder, jobs, servicer
        self._background_stop = background_stop
        self._warmed = warmed

    def wait_warm(self, timeout_s: float | None = None) -> bool:
        """Waits until the start-up work in the background ended: the planner's kernels loaded, the
        decode workers up and counted in the memory budget's baseline (or found unable to start:
        then health reports NOT_SERVING). False on timeout."""
        return self._warmed.wait(timeout_s)

    def stop(self, grace: float | None = None) -> threading.Event:
        """gRPC's stop, then the decode workers; the event is set once both are down."""
        stopped, done = self._server.stop(grace), threading.Event()
        self._background_stop.set()
        self._servicer.watchdog.close()
        self._jobs.close()
        self._servicer.reader.cache.close()
        threading.Thread(target=lambda: (stopped.wait(), self._decoder.close(), done.set()), daemon=True).start()
        return done

    def __getattr__(self, name: str):
        return getattr(self._server, name)
