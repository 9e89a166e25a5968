"""A job: the composition of its parts, and the registry of open jobs.

- documents.py: its datasets' shards read and parsed with their settings (the planner's source);
- retention.py: which documents hold their encoded bytes, charged to the memory budget;
- plans.py: where its plans, acknowledgements and counters live (LocalPlans in this process,
  shared_job.SharedPlans in Redis for several replicas);
- assembly.py: one planned microbatch -> layout -> decoded arrays;
- report.py: what it skipped, and each step's balance.

What is the job's own: who opened and joined it, its open streams, its idle clock, and the size
of its messages (stream admission). Thread-safe."""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from disttrain_api.config import JobConfig
from disttrain_api.errors import ConfigError, JobClosedError, NotFoundError, ServiceUnavailableError
from preprocess_service.adapters.decode import Decoder
from preprocess_service.adapters.infra import metrics
from preprocess_service.adapters.infra.budget import UNLIMITED, MemoryBudget
from preprocess_service.adapters.io import shards
from preprocess_service.adapters.media import tokenizers as text_tokenizers
from preprocess_service.adapters.plugins import registry as plugin_registry
from preprocess_service.adapters.plugins.hooks import DEFAULT_LIMITS, HookLimits
from preprocess_service.core.assemble import MicrobatchArrays
from preprocess_service.core.planner import StepPlan
from preprocess_service.core.sample import Document, VideoRef
from preprocess_service.core.shardnames import ShardNames
from preprocess_service.core.tokenizer import Tokenizer
from preprocess_service.service.assembly import Assembly, PendingMicrobatch
from preprocess_service.service.documents import (
    JobDocuments,
    SideFiles,
    expand_datasets,
    job_tokenizer,
    sample_hooks,
)
from preprocess_service.service.plans import Lease, LocalPlans, PlanSource
from preprocess_service.service.report import PluginCosts, SkipLog
from preprocess_service.service.retention import MediaRetention
from preprocess_service.service.state_files import StateFiles

log = logging.getLogger(__name__)
CLOSED_REMEMBERED = 4096
"""Jobs closed by a client that a JobRegistry remembers as closed."""


class Job:
    """One open job. Its plans come from ``plans(job)`` (a PlanSource made from the job's parts);
    by default a LocalPlans that holds ``retain_steps`` planned steps' media and snapshots the
    planner every ``snapshot_every`` steps."""

    def __init__(self, config: JobConfig, tokenizer: Tokenizer | None = None, *,
                 reader: shards.ShardReader = shards.DEFAULT_READER, shard_urls: list[ShardNames] | None = None,
                 budget: MemoryBudget = UNLIMITED, plans: Callable[[Job], PlanSource] | None = None,
                 retain_steps: int = 4, snapshot_every: int = 1, plugin_limits: HookLimits = DEFAULT_LIMITS):
        self.config = config
        self.job_id = config.job_id()
        plugins = plugin_registry.check(config.plugins)  # an unknown name is refused before anything starts
        self.reader = reader.for_owner(self.job_id)
        """The server's reader, as this job: its share of the remote-shard cache (io/cache.py)."""
        self.tokenizer = tokenizer or job_tokenizer(config.tokenizer, reader.policy)
        self.tokenizer_info = text_tokenizers.describe(self.tokenizer)
        """Ids, vocabulary size and file digest of the tokenizer (JobInfo.tokenizer)."""
        self.skips = SkipLog()
        self.plugin_costs = PluginCosts(self.job_id)
        """What its plugins' hooks have spent here (JobReport.plugins)."""
        self.side_files = SideFiles(self.job_id[:12], self.skips.planning_skip)
        self.retention = MediaRetention(self.reader, budget)
        self.documents = JobDocuments(
            config, self.reader, shard_urls if shard_urls is not None else expand_datasets(reader, config),
            self.tokenizer, self.skips.planning_skip, keep=self.retention.keep, side_files=self.side_files,
            fingerprint=self.tokenizer_info["sha256"] + text_tokenizers.template_digest(self.tokenizer)[:16]
            + (hashlib.sha256(plugins.encode()).hexdigest()[:16] if plugins else ""),
            hooks=sample_hooks(config, plugin_limits, self.plugin_costs.add))
        self.plans: PlanSource = plans(self) if plans is not None else LocalPlans(
            config, self.documents, self.retention, self.skips, retain_steps=retain_steps,
            snapshot_every=snapshot_every)
        self.assembly = Assembly(config, self.tokenizer, self.plans, first_out=self.side_files.first_out,
                                 plugin_limits=plugin_limits, on_hook_costs=self.plugin_costs.add)
        self._lock = threading.Lock()
        self._largest_message = 0
        self._acked_low = 0
        self.state_save_failing = False
        """The last save of its state (state_dir) failed: a full or read-only disk."""
        self.owner = ""
        """Identity (security.client_identity) of the client that opened the job."""
        self.clients: set[str] = set()
        """Identities that opened or joined it: only they may report timings or close it."""
        self.closed = threading.Event()
        self._stream_stops: set[threading.Event] = set()
        self._last_used = time.monotonic()
        self.on_acknowledged: Callable[[int], None] | None = None
        """Called (outside the job's lock) when the lowest acknowledged step moves (the registry saves the state)."""

    @property
    def dataset_urls(self) -> list[ShardNames]:
        """Each dataset's shard names (JobConfig.mixture() order)."""
        return self.documents.dataset_urls

    @property
    def shard_urls(self) -> ShardNames:
        return self.documents.shard_urls

    def listed_shards(self, limit: int) -> list[str]:
        """The first ``limit`` shard names, named once per job (every rank's OpenJob lists them;
        a large pattern makes each name when asked)."""
        listed = self.__dict__.get("_listed")
        if listed is None or listed[0] != limit:
            names = self.shard_urls
            listed = self.__dict__["_listed"] = (limit, [names.safe_name(i) for i in range(min(limit, len(names)))])
        return listed[1]

    # --- plans --------------------------------------------------------------------------------
    def step_plan(self, step: int, stop: threading.Event | None = None) -> StepPlan | None:
        """The plan of ``step``, planning up to it if needed; None past the last step."""
        return self.plans.step_plan(step, stop)

    def plan_ahead(self) -> None:
        self.plans.plan_ahead()

    def num_steps(self) -> int:
        """Steps of the whole job, or -1 while planning has not reached the end."""
        return self.plans.num_steps()

    def plan_all(self) -> int:
        """Plans every step (reads every shard once); returns the number of steps."""
        step = 0
        while self.step_plan(step) is not None:
            step += 1
        return step

    def state_dict(self) -> dict:
        """The plans' state (LocalPlans.state_dict: what a restarted node resumes from)."""
        return self.plans.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict) -> None:
        self.plans.load_state_dict(state)  # type: ignore[attr-defined]

    # --- streaming ------------------------------------------------------------------------------
    def check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.config.dp_size:
            raise ConfigError(f"dp_rank {rank} is outside this job's dp_size {self.config.dp_size}")

    def start_microbatch(self, plan: StepPlan, rank: int, index: int, decoder: Decoder,
                         stop: threading.Event | None = None) -> PendingMicrobatch:
        return self.assembly.start(plan, rank, index, decoder, stop)

    def finish_microbatch(self, pending: PendingMicrobatch):
        return self.assembly.finish(pending)

    def microbatch(self, plan: StepPlan, rank: int, index: int, decoder: Decoder) -> MicrobatchArrays:
        """One microbatch decoded and copied out of the decode buffer (for tests and tools)."""
        return self.assembly.copy(plan, rank, index, decoder)

    def open_stream(self, rank: int, start_step: int, stop: threading.Event) -> Lease:
        """Registers a stream of ``rank``; the server reports each step it finishes to the lease."""
        return self.plans.open_lease(rank, start_step, stop)

    def note_message_bytes(self, nbytes: int) -> None:
        """The size of a microbatch message sent; the largest so far sizes new streams' admission."""
        self._largest_message = max(self._largest_message, nbytes)

    def stream_estimate(self, prefetch: int, start_step: int = 0, rank: int = 0) -> int:
        """Bytes a stream of this job may hold: two microbatches in decode (each a shared-memory
        arena rounded up to a power of two, with room for the encoded inputs) plus a media-free
        one (streams.py lets it pass the decode slots: one minimal arena), ``prefetch`` prepared
        messages, and two with gRPC (the one being sent and gRPC's copy of the one before).
        Sized by the largest message seen; before any, by the config's bound (with video's two
        frames a token only when the stream's first step is planned and holds a video)."""
        # before any message: the worst case of what the first step holds (video tokens cost two frames)
        per = self._largest_message or self.config.max_microbatch_bytes(video=self._plans_video(start_step))
        minimal = 1 << 22
        arena = max(minimal, 1 << (int(per * 1.5) - 1).bit_length())
        return 2 * arena + minimal + (prefetch + 2) * per

    def _plans_video(self, step: int) -> bool:
        """Whether ``step`` is planned and held and has a video (not planned yet: priced as before
        video, and the first message's real size replaces the estimate)."""
        plan = self.plans.held(step)
        if plan is None:
            return False
        # a replica's plan read from Redis holds DocRefs until resolved: what they hold is not known yet
        return any(isinstance(s, VideoRef) for doc in plan.documents() if isinstance(doc, Document)
                   for s in doc.segments)

    # --- feedback, acknowledgements, report -----------------------------------------------------
    def report_timings(self, timings: list[tuple[int, int, int, float, float, float, float]]) -> dict:
        """Refits the cost model from measured (step, rank, microbatch, encoder_s, backbone_s,
        generator_s, total_s); the steps planned from now on are priced with it (feedback.py)."""
        return self.plans.report_timings(timings)

    def acknowledge(self, rank: int, next_step: int) -> int:
        """``rank`` checkpointed its state before ``next_step``: it never resumes before it."""
        self.check_rank(rank)
        low = self.plans.acknowledge(rank, next_step)
        metrics.ACKED_STEP.labels(self.job_id).set(low)
        with self._lock:
            moved, self._acked_low = low > self._acked_low, max(self._acked_low, low)
        if moved and self.on_acknowledged is not None:
            self.on_acknowledged(low)
        return low

    def report(self) -> dict:
        self.side_files.flush()
        return {**self.plans.report(), "plugins": self.plugin_costs.rows()}

    def summary(self) -> dict:
        """What ListJobs says of it: its shape, progress and clients (no shard names)."""
        report = self.report()
        with self._lock:
            streams, clients, acked = len(self._stream_stops), sorted(self.clients), self._acked_low
        config = self.config
        return {"job_id": self.job_id, "dp_size": config.dp_size, "num_microbatches": config.num_microbatches,
                "seq_len": config.seq_len, "datasets": [d.name for d in config.mixture()],
                "num_planned_steps": report["num_planned_steps"], "planning_done": report["planning_done"],
                "num_sent_microbatches": report["num_sent_microbatches"], "acknowledged_step": acked,
                "num_streams": streams, "clients": clients, "num_skipped": len(report["skipped"]),
                "idle_s": self.idle_s(), "warnings": self.warnings()}

    def warnings(self) -> list[str]:
        """What is wrong with the job's durability now (JobSummary.warnings): said in the log and
        the metrics as it happens, and here while it matters."""
        out = []
        lost = getattr(self.plans, "lost_writes", 0)
        if lost:
            out.append(f"Redis lost acknowledged writes {lost} time(s) (a failover or a restart without AOF): "
                       "the missing steps were planned again")
        if self.state_save_failing:
            out.append("its state cannot be saved to state_dir (a full or read-only disk): a restart resumes "
                       "from the last state saved there")
        return out

    # --- lifecycle ------------------------------------------------------------------------------
    def touch(self) -> None:
        """A call used the job: its idle clock starts again."""
        self._last_used = time.monotonic()

    def idle_s(self) -> float:
        """Seconds since the job was last used; 0 while a stream is open."""
        with self._lock:
            return 0.0 if self._stream_stops else time.monotonic() - self._last_used

    def add_stream(self, stop: threading.Event) -> None:
        """Registers an open stream; closing the job sets ``stop``."""
        with self._lock:
            if self.closed.is_set():
                stop.set()
            self._stream_stops.add(stop)

    def remove_stream(self, stop: threading.Event) -> None:
        with self._lock:
            self._stream_stops.discard(stop)
        self.touch()

    def close(self) -> int:
        """Ends the job: open streams stop, plans and held bytes are dropped, background work
        stops. Returns the number of streams it ended."""
        with self._lock:
            self.closed.set()
            stops = list(self._stream_stops)
        self.plans.close()
        self.retention.close()
        if self.documents.hooks is not None:
            self.documents.hooks.close()
        for stop in stops:
            stop.set()
        return len(stops)


class JobFactory(Protocol):
    """How a registry makes its jobs: in this process (LocalJobs) or shared through Redis
    (shared_job.SharedJobs)."""

    budget: MemoryBudget
    """What the jobs' held media are charged to."""

    def new(self, config: JobConfig, reader: shards.ShardReader, shard_urls: list[ShardNames] | None) -> Job: ...

    def owner(self, job: Job, client: str) -> str:
        """Who owns the job ``client`` just opened or joined (``job.owner``: who opened it here)."""

    def find(self, job_id: str) -> tuple[JobConfig, shards.ShardReader] | None:
        """The config of a job opened elsewhere (another replica) and the reader to open it with
        here; None if there is none."""


class LocalJobs:
    """Jobs in this process. With ``state_dir``, every acknowledgement that moves a job's lowest
    acknowledged step writes the job's state (``Job.state_dict()``) to ``state_dir/JOB_ID.json``
    and ``state_dir/LINEAGE.json`` (atomically; JobConfig.lineage_id). The same job opened again
    (after a restart of this node) continues from the first at its acknowledged step, not from
    step 0; a job of the lineage with another layout continues from the second when a client asks
    (JobRegistry.continue_lineage: elastic resume)."""

    def __init__(self, budget: MemoryBudget = UNLIMITED, state_dir: str | Path | None = None,
                 plugin_limits: HookLimits = DEFAULT_LIMITS):
        self.budget = budget
        self.plugin_limits = plugin_limits
        self.state_dir = Path(state_dir) if state_dir else None
        self.state_files: StateFiles | None = None
        if self.state_dir is not None:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self.state_files = StateFiles(self.state_dir)

    def new(self, config: JobConfig, reader: shards.ShardReader, shard_urls: list[ShardNames] | None) -> Job:
        job = self._job(config, reader, shard_urls)
        if self.state_dir is None:
            return job
        own = self.state_dir / f"{job.job_id}.json"
        state = self.saved(own)
        if state is None:
            return job
        try:
            job.load_state_dict(state)
            log.info("job %s: resumed from %s at step %s", job.job_id, own, state.get("snapshot_step"))
            return job
        except (ValueError, KeyError, TypeError) as exc:  # e.g. planned with another tokenizer file
            log.warning("job %s: cannot resume from %s (%s); planning from step 0", job.job_id, own, exc)
        return self._job(config, reader, shard_urls)

    def _job(self, config: JobConfig, reader: shards.ShardReader, shard_urls: list[ShardNames] | None) -> Job:
        job = Job(config, reader=reader, shard_urls=shard_urls, budget=self.budget,
                  plugin_limits=self.plugin_limits)
        if self.state_files is not None:
            job.on_acknowledged = self.state_files.saver(
                job.job_id, [self.state_files.state_dir / f"{job.job_id}.json", self.lineage_path(config)],
                job.state_dict, functools.partial(setattr, job, "state_save_failing"))
        return job

    def lineage_path(self, config: JobConfig) -> Path:
        """The newest state any job of ``config``'s lineage saved (what an elastic resume reads)."""
        assert self.state_dir is not None
        return self.state_dir / f"{config.lineage_id()}.json"

    def saved(self, path: Path) -> dict | None:
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("ignoring the saved job state %s (%s)", path, exc)
            return None

    def owner(self, job: Job, client: str) -> str:
        return job.owner  # whoever opened it here

    def find(self, job_id: str) -> tuple[JobConfig, shards.ShardReader] | None:
        return None

    def close(self) -> None:
        """Stops writing refused states again (the service stops)."""
        if self.state_files is not None:
            self.state_files.close()


class JobRegistry:
    """Open jobs by id; opening an identical config returns the same job. ``factory`` makes them
    (default: LocalJobs with ``budget`` and ``state_dir``)."""

    def __init__(self, budget: MemoryBudget = UNLIMITED, state_dir: str | Path | None = None, *,
                 factory: JobFactory | None = None, plugin_limits: HookLimits = DEFAULT_LIMITS):
        self._lock = threading.Lock()
        self._jobs: dict[str, Job] = {}
        self._closed: collections.OrderedDict[str, None] = collections.OrderedDict()
        """Ids of the last CLOSED_REMEMBERED jobs a client closed (JobClosedError, not NotFoundError)."""
        self._continuing = threading.Lock()
        self.factory: JobFactory = factory or LocalJobs(budget, state_dir, plugin_limits)
        self.budget = self.factory.budget
        self.plan_ahead = True
        """A job opened here plans its first step at once (Job.plan_ahead); False: at its first stream."""

    def open(self, config: JobConfig, *, shard_urls: list[ShardNames] | None = None,
             reader: shards.ShardReader = shards.DEFAULT_READER, client: str = "") -> Job:
        """The open job of ``config``, opened if need be (``client`` becomes its owner) and joined by
        ``client``; its shards are expanded before the lock is taken (an expansion can take a
        while; nothing else waits for it)."""
        job_id = config.job_id()
        with self._lock:
            job = self._jobs.get(job_id)
        created = None
        if job is None:
            created = job = self.factory.new(config, reader, shard_urls)
            job.owner = client
        with self._lock:
            job = self._jobs.setdefault(job_id, job)
            job.clients.add(client)
            self._closed.pop(job_id, None)
        job.owner = self.factory.owner(job, client)
        if job is created and self.plan_ahead:
            job.plan_ahead()
        job.touch()
        return job

    def continue_lineage(self, config: JobConfig, step: int, client: str, *,
                         shard_urls: list[ShardNames] | None = None,
                         reader: shards.ShardReader = shards.DEFAULT_READER) -> Job:
        """Elastic resume, asked for by a client whose checkpoint stands at ``step`` of another
        layout of ``config``'s lineage (the same data; a trainer restarted with fewer or more
        ranks): the job of ``config`` continues from the lineage's state acknowledged at exactly
        ``step``, from a job of the lineage open here or the state_dir. A job that already starts
        there is returned as it is; one that has sent microbatches from elsewhere, or a lineage with
        no state at ``step``, is NotFoundError (never a silent restart from step 0)."""
        with self._continuing:  # ranks ask at once: the first continues the job, the others find it done
            return self._continue(config, step, client, shard_urls, reader)

    def _continue(self, config: JobConfig, step: int, client: str, shard_urls: list[ShardNames] | None,
                  reader: shards.ShardReader) -> Job:
        job = self.open(config, shard_urls=shard_urls, reader=reader, client=client)
        plans = job.plans
        if not isinstance(plans, LocalPlans):
            raise NotFoundError("elastic resume needs a single-node service (this job's plans are shared in Redis)")
        if plans.first_step() == step:
            return job
        if plans.num_sent_microbatches or any(plans.state_dict()["acked"].values()):
            raise NotFoundError(f"job {job.job_id} already streams from step {plans.first_step()}; it cannot "
                                f"continue its lineage at step {step}")
        state = self._lineage_state(config, step, client)
        with self._lock:
            if self._jobs.get(job.job_id) is not job:
                raise ServiceUnavailableError(f"job {job.job_id} changed while it was continued; open it again")
        fresh = self.factory.new(config, reader, shard_urls or job.documents.dataset_urls)
        fresh.owner, fresh.clients = job.owner, set(job.clients)
        fresh.load_state_dict(state)
        with self._lock:
            self._jobs[job.job_id] = fresh
        job.close()  # its plan-ahead of step 0 ends; nothing was sent from it
        if self.plan_ahead:
            fresh.plan_ahead()
        log.info("job %s continues job %s of its lineage at step %d (dp_size %s -> %d)", fresh.job_id,
                 state.get("job_id"), step, state.get("dp_size"), config.dp_size)
        return fresh

    def _lineage_state(self, config: JobConfig, step: int, client: str) -> dict:
        lineage = config.lineage_id()
        with self._lock:
            open_jobs = [other for other in self._jobs.values() if other.job_id != config.job_id()
                         and other.config.lineage_id() == lineage and isinstance(other.plans, LocalPlans)
                         and (other.owner == client or not other.owner.startswith("token:"))]
        states = [other.plans.state_dict() for other in open_jobs]
        if isinstance(self.factory, LocalJobs) and self.factory.state_dir is not None:
            saved = self.factory.saved(self.factory.lineage_path(config))
            if saved is not None:
                states.append(saved)
        for state in states:
            if state.get("acked_step") == step and state.get("planner") is not None \
                    and state.get("snapshot_step") == step:
                return state
        found = sorted({state.get("acked_step") for state in states if state.get("acked_step") is not None})
        if step in found:  # e.g. acknowledged at the end of its data, where the planner keeps no state
            raise NotFoundError(f"the job of this lineage that acknowledged step {step} holds no planner state at "
                                "that step, so another layout cannot continue it there")
        raise NotFoundError(f"no job of this lineage acknowledged step {step} here (acknowledged: {found or 'none'}); "
                            "elastic resume continues from the step every rank acknowledged")

    def close_job(self, job_id: str, *, by_client: bool = True) -> int:
        """Closes and forgets a job; returns the number of streams that were ended. A job a client
        closed is remembered as closed (its calls get JobClosedError) until it is opened again."""
        with self._lock:
            job = self._jobs.pop(job_id, None)
            if job is not None and by_client:
                self._closed[job_id] = None
                while len(self._closed) > CLOSED_REMEMBERED:
                    self._closed.popitem(last=False)
        if job is None:
            raise NotFoundError(f"no open job with id {job_id!r}")
        return job.close()

    def expire(self, idle_ttl_s: float) -> list[str]:
        """Closes every job unused for ``idle_ttl_s`` (no stream open, no call); returns their ids."""
        with self._lock:
            idle = [job_id for job_id, job in self._jobs.items() if job.idle_s() > idle_ttl_s]
        closed = []
        for job_id in idle:
            try:
                self.close_job(job_id, by_client=False)  # a client may open it again by itself
                closed.append(job_id)
            except NotFoundError:
                pass  # closed meanwhile
        return closed

    def num_open(self) -> int:
        with self._lock:
            return len(self._jobs)

    def num_owned(self, client: str) -> int:
        """Jobs ``client`` opened that are still open."""
        with self._lock:
            return sum(1 for job in self._jobs.values() if job.owner == client)

    def open_jobs(self) -> list[Job]:
        """Every job open here, oldest first."""
        with self._lock:
            return list(self._jobs.values())

    def is_open(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._jobs

    def get(self, job_id: str) -> Job:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is not None:
            job.touch()
            return job
        with self._lock:
            closed = job_id in self._closed
        if closed:
            raise JobClosedError(f"job {job_id!r} was closed (CloseJob); open it again to start it anew")
        found = self.factory.find(job_id)
        if found is None:
            raise NotFoundError(f"no open job with id {job_id!r}; call OpenJob first")
        config, reader = found
        return self.open(config, reader=reader)

    def close(self) -> None:
        """Closes every job, then the factory's connections, if it has any (server shutdown)."""
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            job.close()
        close = getattr(self.factory, "close", None)
        if close is not None:
            close()
