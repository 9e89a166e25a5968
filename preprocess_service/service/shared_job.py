"""A job served by several replicas through Redis (store.py): any replica streams any rank.

How a step travels:
1. A stream that needs step k asks Redis for its committed plan and, in the same round trip,
   records that it reads k and wakes the planner; if the plan is not there yet, it polls.
2. Exactly one replica holds the job's planning lease (it expires unless renewed, so a dead
   replica's lease passes to another within ``lease_ttl_s``). Its planner thread plans up to
   ``lookahead`` steps beyond the furthest step read, and commits each plan (SET NX) before anyone streams it.
   Before every ``snapshot_every``-th step it also stores the planner's state (core/planner.py).
   A replica that takes the lease over loads the newest stored state at or before the last
   committed step and replays from there (planning is deterministic) without committing again:
   at most ``snapshot_every`` steps, wherever in the epoch the takeover happens.
3. Every replica streams from the committed plans only, re-reading the microbatch's samples
   from the shards, so a microbatch has the same content whichever replica sends it.
4. Each stream holds its rank's step lease and fence token: a newer stream of the same rank
   (the client reconnected elsewhere) makes the older one stop at its next step boundary.
5. Trainers acknowledge steps once a checkpoint holding the client state is durable; plans of
   steps every rank has acknowledged are dropped.
6. Cost feedback (JobSpec.cost_feedback): whichever replica a trainer reports its timings to
   turns them into observations with the features the committed plan keeps, and appends them to
   a bounded list in Redis; the planning replica refits from that list before each step it
   commits and records the coefficients in the plan, so a planner that takes over replays every
   step with the prices it was planned with.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import uuid

from disttrain_api import preprocess_pb2 as pb
from disttrain_api.config import JobConfig
from disttrain_api.errors import (
    DataQualityError,
    FeedbackDisabled,
    NotFoundError,
    SampleError,
    ServiceUnavailableError,
    StreamSuperseded,
)
from disttrain_api.spec import config_from_spec, spec_from_config
from preprocess_service.adapters.infra import metrics
from preprocess_service.adapters.infra.budget import UNLIMITED, MemoryBudget
from preprocess_service.adapters.infra.store import RedisStore
from preprocess_service.adapters.io import shards
from preprocess_service.adapters.plugins.hooks import DEFAULT_LIMITS, HookLimits
from preprocess_service.core import plan_record
from preprocess_service.core.feedback import (
    REFIT_FIELDS,
    CostRefitter,
    Observation,
    microbatch_features,
    observation_from_json,
    observation_json,
    sum_features,
)
from preprocess_service.core.packing import PackedSequence
from preprocess_service.core.planner import EpochPlanner, StepPlan
from preprocess_service.core.sample import EPOCH
from preprocess_service.core.shardnames import ShardNames
from preprocess_service.service.documents import SideFiles
from preprocess_service.service.job import Job, JobRegistry
from preprocess_service.service.report import SkippedRecord, plan_balance

log = logging.getLogger(__name__)


class SharedPlans:
    """One replica's PlanSource for a job whose plans, leases and acknowledgements live in Redis."""

    def __init__(self, job: Job, store: RedisStore, replica_id: str, *, lookahead: int = 2,
                 lease_ttl_s: float = 5.0, rank_lease_ttl_s: float = 30.0, cache_steps: int = 64,
                 poll_s: float = 0.02, snapshot_every: int = 4, stream_store: RedisStore | None = None):
        self.config, self.job_id = job.config, job.job_id
        self.reader = job.reader
        self.documents = job.documents.with_sink(
            self._planning_skip, keep=lambda doc: False,  # served from re-read samples: hold no bytes
            side_files=SideFiles(job.job_id[:12], self._planning_skip, defer=False))
        self.refitter = CostRefitter(self.config.cost) if self.config.cost_feedback else None
        self.snapshot_every = snapshot_every
        self._lock = threading.Lock()
        self._dataset_counts: list[dict] = []
        """The planner's per-dataset counts as of its last step (this replica's planner only)."""
        self.store = store
        self.stream_store = stream_store or store
        """Redis for what a client waits on (plans, its rank's lease, acknowledgements, reports): calls
        bounded by the service's stream_redis_timeout_s, so that on a replica cut from Redis they fail
        with UNAVAILABLE and the client moves to another replica; the planner rides faults out."""
        self.replica_id = replica_id
        self.lookahead = lookahead
        self.lease_ttl_s = lease_ttl_s
        self.rank_lease_ttl_s = rank_lease_ttl_s
        self.poll_s = poll_s
        self._token = f"{replica_id}/{uuid.uuid4().hex[:8]}"
        self._cache: collections.OrderedDict[int, StepPlan] = collections.OrderedDict()
        self._cache_steps = cache_steps
        self._num_steps: int | None = None
        self._dropped_through = 0  # plans of steps < this were dropped after acknowledgement
        self._frontier_seen = 0
        """The most committed steps this replica has read: Redis holding fewer lost writes."""
        self.lost_writes = 0
        self._closed = threading.Event()
        self._planner_thread: threading.Thread | None = None
        self._planner_error: BaseException | None = None
        self._planning_skips: dict[str, str] = {}
        self.spec_bytes = spec_from_config(self.config).SerializeToString()

    # --- reading committed plans ------------------------------------------------------------
    def step_plan(self, step: int, stop: threading.Event | None = None) -> StepPlan | None:
        """The committed plan of ``step``, waiting for the planner if need be; None past the end."""
        polls = 0
        while True:
            with self._lock:
                plan = self._cache.get(step)
                if plan is not None:
                    self._cache.move_to_end(step)
                    return plan
            before = self._frontier_seen  # read before the round trip: a later commit is no loss
            data, frontier, done = self.stream_store.read_plan(self.job_id, step, want=True, stop=stop)
            self._observe_frontier(frontier, before)
            if data is not None:
                return self._remember(plan_record.decode(data))
            if done is not None:
                with self._lock:
                    self._num_steps = done
                if step >= done:
                    return None
            if step < frontier:
                raise NotFoundError(f"the plan of step {step} was dropped: every rank acknowledged a later "
                                    f"step, so no rank may resume before it")
            error, self._planner_error = self._planner_error, None  # reported once; the next call plans again
            if isinstance(error, DataQualityError):
                raise error
            if error is not None:
                raise RuntimeError(f"planning job {self.job_id} failed on this replica: {error!r}") from error
            self._ensure_planner()
            if polls > 0 and (stop or self._closed).wait(min(self.poll_s * polls, 0.2)):
                raise ServiceUnavailableError(f"stopped while waiting for the plan of step {step}")
            polls += 1

    def _observe_frontier(self, frontier: int, before: int) -> None:
        """Redis holding fewer committed steps than this replica read before lost acknowledged writes
        (a failover to a replica that had not received them, a restart without AOF): said loudly.
        The planner commits the missing steps again; planning is deterministic, and this replica
        serves the steps it holds as it served them before."""
        with self._lock:
            # against what was seen before this read left: one that overtook it is no loss
            lost = frontier < before and self._frontier_seen == before
            self._frontier_seen = frontier if lost else max(self._frontier_seen, frontier)  # once per loss
            self.lost_writes += lost
        if lost:
            metrics.REDIS_LOST_WRITES.labels(self.job_id).inc()
            log.error("job %s: Redis at %s holds %d committed steps where this replica read %d before: it lost "
                      "acknowledged writes (a failover to a replica behind its primary, or a restart without "
                      "AOF); the missing steps are planned again", self.job_id, self.store.address, frontier, before)

    def _remember(self, plan: StepPlan) -> StepPlan:
        with self._lock:
            self._cache[plan.step] = plan
            while len(self._cache) > self._cache_steps:
                self._cache.popitem(last=False)
        return plan

    def num_steps(self) -> int:
        with self._lock:
            return -1 if self._num_steps is None else self._num_steps

    # --- the planner thread -----------------------------------------------------------------
    def plan_ahead(self) -> None:
        """As Job.plan_ahead: the planner thread competes for the lease now, not at the first stream."""
        self._ensure_planner()

    def _ensure_planner(self) -> None:
        with self._lock:
            if self._planner_thread is None or not self._planner_thread.is_alive():
                self._planner_thread = threading.Thread(target=self._planner_loop, daemon=True,
                                                        name=f"planner-{self.job_id}")
                self._planner_thread.start()

    def _planner_loop(self) -> None:
        """Competes for the planning lease; while holding it, plans what the streams want."""
        planner, next_step, seen_frontier = None, 0, 0
        stop = self._closed
        try:
            while not stop.is_set():
                before = self._frontier_seen
                held, frontier, want, done = self.store.planner_view(self.job_id, self._token, self.lease_ttl_s,
                                                                     stop=stop)
                self._observe_frontier(frontier, before)
                if done is not None:
                    return
                if not held:
                    stop.wait(self.lease_ttl_s / 3)  # standby: the holder may die
                    continue
                if frontier < seen_frontier:
                    log.warning("job %s: Redis lost committed plans (frontier %d, was %d; restarted without "
                                "AOF?): replanning from the start, plans are deterministic",
                                self.job_id, frontier, seen_frontier)
                    planner = None
                seen_frontier = frontier
                if planner is None:
                    planner = EpochPlanner(self.config, self.documents.dataset_urls, self.documents)
                    state = self.store.resume_state(self.job_id, stop=stop)
                    if state is not None:
                        planner.load_state_dict(json.loads(state))
                    next_step = planner.step
                    log.info("job %s: planning from step %d (epoch %d), %d steps committed",
                             self.job_id, next_step, planner.epoch, frontier)
                if next_step >= max(frontier, want + 1 + self.lookahead):  # replay, else stay lookahead ahead
                    self.store.wait_for_want(self.job_id, timeout_s=min(self.lease_ttl_s / 3, 5.0), stop=stop)
                    continue
                if self.refitter is not None:
                    planner.cost = self._cost_for(next_step, frontier, stop)
                if next_step % self.snapshot_every == 0 and not planner.done:
                    self.store.save_state(self.job_id, next_step, json.dumps(planner.state_dict()), stop=stop)
                plan = planner.next_plan()
                self._dataset_counts = planner.dataset_counts()
                if plan is None:
                    if not self.store.commit_done(self.job_id, next_step, stop=stop):
                        planner = None  # steps are missing (Redis lost them): plan them again
                        continue
                    return
                skips, self._planning_skips = self._planning_skips, {}
                record = plan_record.encode(plan, **self._feedback_fields(plan, planner))
                if plan.step < frontier:  # a replay: it must match what was committed
                    committed = self.store.committed_plan(self.job_id, plan.step, stop=stop)
                    if committed is not None and committed != record:
                        log.error("job %s: replaying step %d gave a different plan than the committed one (a "
                                  "shard read failed or changed?); replanning from the epoch start in %g s",
                                  self.job_id, plan.step, self.lease_ttl_s)
                        planner = None
                        stop.wait(self.lease_ttl_s)
                        continue
                else:
                    self.store.commit_plan(self.job_id, plan.step, record,
                                           sum(1 for _ in plan.documents()), skips, self._token,
                                           self.lease_ttl_s, stop=stop)
                    seen_frontier = max(seen_frontier, plan.step + 1)
                next_step = plan.step + 1
        except ServiceUnavailableError:
            return  # closed while Redis was away
        except BaseException as exc:
            log.exception("job %s: planning failed", self.job_id)
            self._planner_error = exc
        finally:
            self.store.release(self.job_id, "planner", self._token)

    def _feedback_fields(self, plan: StepPlan, planner: EpochPlanner) -> dict:
        if self.refitter is None:
            return {}
        return {"cost_model": {name: getattr(planner.cost, name) for name in REFIT_FIELDS},
                "features": [microbatch_features([seq]) for seq in plan.sequences]}

    def _cost_for(self, step: int, frontier: int, stop: threading.Event):
        """The coefficients to price ``step`` with: a committed step's own (a replay must plan it
        as it was), else a refit on the observations in Redis."""
        if step < frontier:
            committed = self.store.committed_plan(self.job_id, step, stop=stop)
            cost_model = plan_record.feedback_fields(committed)[0] if committed is not None else None
            if cost_model:
                return dataclasses.replace(self.config.cost, **cost_model)
        return self._refit(stop)[0]

    def _refit(self, stop: threading.Event | None):
        refitter = CostRefitter(self.config.cost, window=self.refitter.window,
                                min_observations=self.refitter.min_observations)
        for row in self.store.timings(self.job_id, stop=stop):
            refitter.add(observation_from_json(row))
        return refitter.refit(), dict(refitter.errors)

    def _planning_skip(self, exc: SampleError) -> None:
        record = SkippedRecord.of(exc)
        metrics.DECODE_ERRORS.labels(exc.kind, "plan").inc()  # a replay after a takeover counts again
        self._planning_skips.setdefault(record.record_id, record.to_json())

    # --- serving ----------------------------------------------------------------------------
    def resolve(self, sequences: list[PackedSequence], epoch: int = 0) \
            -> tuple[list[PackedSequence], list[SkippedRecord]]:
        """Documents rebuilt from their samples (of ``epoch``: what plugins are told), re-read from
        the shards; a sample that is gone or
        no longer matches its plan is left out and reported (every replica reads the same shards,
        so every replica leaves out the same ones)."""
        wanted: dict[str, set[str]] = collections.defaultdict(set)
        for seq in sequences:
            for ref in seq.documents:
                wanted[ref.shard].add(ref.key)
        samples = {(url, key): sample for url, keys in wanted.items()
                   for key, sample in self.reader.read_samples(url, keys).items()}
        out, lost = [], []
        for seq in sequences:
            documents = []
            for ref in seq.documents:
                problem, doc = self._rebuild(ref, samples.get((ref.shard, ref.key)), epoch)
                if doc is not None:
                    documents.append(doc)
                else:
                    lost.append(SkippedRecord(ref.key, ref.shard, problem, "shard_error"))
            out.append(PackedSequence(seq_len=seq.seq_len, documents=documents, cost=seq.cost))
        if lost:
            self.lost(lost)
        return out, lost

    def taken(self, plan: StepPlan, rank: int, index: int) -> None:
        pass  # committed plans hold references, never bytes

    def held(self, step: int) -> StepPlan | None:
        with self._lock:
            return self._cache.get(step)

    def lost(self, records: list[SkippedRecord]) -> None:
        """Documents lost while serving go to Redis, so every replica's report has them."""
        for record in records:  # counted where lost (a replay after a takeover counts again)
            metrics.DECODE_ERRORS.labels(record.kind, "decode").inc()
        self.stream_store.record_skipped(self.job_id, {r.record_id: r.to_json() for r in records}, stop=self._closed)

    def _rebuild(self, ref: plan_record.DocRef, sample: dict | None, epoch: int):
        if sample is None:
            return "not found when re-reading its shard (did the shard change after planning?)", None
        sample[EPOCH] = epoch
        try:
            doc = self.documents.parse_only(sample)
        except SampleError as exc:
            return f"re-read from its shard, it no longer parses: {exc.reason}", None
        if doc.num_tokens != ref.num_tokens:
            return (f"re-read from its shard, it has {doc.num_tokens} tokens where the plan has "
                    f"{ref.num_tokens} (did the shard change after planning?)"), None
        return "", doc

    def report_timings(self, timings) -> dict:
        """Measured (step, rank, microbatch, encoder_s, backbone_s, generator_s, total_s) -> observations
        in Redis, priced by the features the committed plans keep; returns this replica's refit
        (the planning replica refits the same way before each step it commits)."""
        if self.refitter is None:
            raise FeedbackDisabled(f"job {self.job_id} was opened without cost_feedback; its plans do not "
                                   "take measured timings")
        plans, rows = {}, []
        for step, rank, index, enc, bb, gen, total in timings:
            if step not in plans:
                data = self.stream_store.committed_plan(self.job_id, step, stop=self._closed) if step >= 0 else None
                features = plan_record.feedback_fields(data)[1] if data is not None else None
                plans[step] = (plan_record.decode(data), features) if features is not None else None
            if plans[step] is None or not 0 <= rank < self.config.dp_size \
                    or not 0 <= index < plans[step][0].num_microbatches:
                continue  # a step never planned, or dropped after every rank acknowledged it
            plan, features = plans[step]
            observed = sum_features(features[i] for i in plan.assignment[rank, index])
            rows.append(observation_json(Observation(observed, (enc, bb, gen), total)))
        total, frontier = self.stream_store.add_timings(self.job_id, rows, self.refitter.window)
        cost, errors = self._refit(self._closed)
        # the planner may be pricing step ``frontier`` with what it read before these rows landed
        return {"cost": cost, "num_observations": total, "first_step_priced": frontier + 1, "errors": errors}

    def open_lease(self, rank: int, start_step: int, stop: threading.Event) -> FencedLease:
        return FencedLease(self, rank, start_step, stop)

    # --- acknowledgements and report --------------------------------------------------------
    def acknowledge(self, rank: int, next_step: int) -> int:
        """Records that ``rank`` will never resume before ``next_step``; drops the plans of steps
        every rank has acknowledged. Returns the lowest acknowledged step over all ranks."""
        low = self.stream_store.acknowledge(self.job_id, rank, next_step, self.config.dp_size)
        with self._lock:
            drop = range(self._dropped_through, low)
            for step in drop:
                self._cache.pop(step, None)
        try:
            self.stream_store.drop_plans(self.job_id, drop, keep_state_from=low)
        except ServiceUnavailableError:
            return low  # the acknowledgement is recorded; the next one drops these plans too
        with self._lock:
            self._dropped_through = max(self._dropped_through, low)
        return low

    def report(self) -> dict:
        shared = self.stream_store.report(self.job_id)
        with self._lock:
            cached = list(self._cache.values())
        return {
            "skipped": [SkippedRecord(**r) for r in shared["skipped"]],
            "num_planned_samples": shared["counters"].get("planned_samples", 0),
            "num_planned_steps": shared["frontier"],
            "planning_done": shared["done"] is not None,
            "num_sent_microbatches": shared["counters"].get("sent_microbatches", 0),
            "step_balance": [plan_balance(plan) for plan in sorted(cached, key=lambda p: p.step)],
            "failure": "" if self._planner_error is None else str(self._planner_error),
            "datasets": self._dataset_counts,  # only the replica that plans knows them (none: [])
        }

    def close(self) -> None:
        self._closed.set()



class FencedLease:
    """A stream's step lease on its rank; fenced, so only the newest stream of a rank goes on."""

    def __init__(self, plans: SharedPlans, rank: int, start_step: int, stop: threading.Event):
        self.plans, self.rank, self.stop = plans, rank, stop
        self.stream_id = uuid.uuid4().hex[:12]
        self.info = {"replica": plans.replica_id, "stream": self.stream_id, "step": start_step}
        if stop.is_set():  # a request whose client left while it waited must not fence the live stream
            raise ServiceUnavailableError("the client cancelled the stream before it started")
        self.fence = plans.stream_store.claim_rank(plans.job_id, rank, self.info, plans.rank_lease_ttl_s,
                                                   plans.spec_bytes, stop=stop)

    def step_sent(self, step: int, num_microbatches: int) -> None:
        plans = self.plans
        self.info["step"] = step + 1
        fence = plans.stream_store.step_sent(plans.job_id, self.rank, self.info, plans.rank_lease_ttl_s,
                                             num_microbatches, stop=self.stop)
        if fence != self.fence:
            raise StreamSuperseded(f"rank {self.rank} of job {plans.job_id} is now streamed by a newer stream; "
                                   f"this one (on {plans.replica_id}) stops after step {step}")

    def close(self) -> None:
        pass


class SharedJobs:
    """Jobs of this replica, registered in Redis: a stream for a job another replica opened finds
    its spec there and opens the same job here; its owner is whoever opened it first anywhere."""

    def __init__(self, store: RedisStore, replica_id: str, *, reader: shards.ShardReader = shards.DEFAULT_READER,
                 budget: MemoryBudget = UNLIMITED, plugin_limits: HookLimits = DEFAULT_LIMITS,
                 stream_timeout_s: float | None = None, **plan_options):
        self.store, self.replica_id, self.budget = store, replica_id, budget
        self.stream_store = store.impatient(stream_timeout_s) if stream_timeout_s else store
        # the planners' tries are bounded like the streams' (a primary gone in a failover is left in
        # about stream_timeout_s, not the socket timeout), and retried as long as the store's
        self.planner_store = store.impatient(stream_timeout_s, retry_deadline_s=store.retry_deadline_s) \
            if stream_timeout_s else store
        self.plugin_limits = plugin_limits
        self.reader = reader
        """Used for jobs this replica learns of from Redis (a spec there is checked like a request)."""
        self.plan_options = plan_options

    def close(self) -> None:
        """Closes the connections to Redis (server shutdown, after its jobs)."""
        for store in {id(s): s for s in (self.stream_store, self.planner_store, self.store)}.values():
            store.close()

    def new(self, config: JobConfig, reader: shards.ShardReader, shard_urls: list[ShardNames] | None) -> Job:
        def plans(job: Job) -> SharedPlans:
            return SharedPlans(job, self.planner_store, self.replica_id, stream_store=self.stream_store,
                               **self.plan_options)

        job = Job(config, reader=reader, shard_urls=shard_urls, budget=self.budget, plans=plans,
                  plugin_limits=self.plugin_limits)
        self.stream_store.register_job(job.job_id, job.plans.spec_bytes)  # type: ignore[attr-defined]
        return job

    def owner(self, job: Job, client: str) -> str:
        return self.stream_store.job_owner(job.job_id, client)

    def find(self, job_id: str) -> tuple[JobConfig, shards.ShardReader] | None:
        spec = self.stream_store.job_spec(job_id)
        if spec is None:
            raise NotFoundError(f"no job with id {job_id!r} is registered in Redis at {self.store.address}; "
                                "call OpenJob first")
        return config_from_spec(pb.JobSpec.FromString(spec)), self.reader


def shared_registry(store: RedisStore, replica_id: str, *, reader: shards.ShardReader = shards.DEFAULT_READER,
                    budget: MemoryBudget = UNLIMITED, plugin_limits: HookLimits = DEFAULT_LIMITS,
                    stream_timeout_s: float | None = None, **plan_options) -> JobRegistry:
    """A registry of jobs shared through ``store`` (SharedJobs); streams wait on Redis at most
    ``stream_timeout_s`` (None: as long as ``store`` does)."""
    return JobRegistry(factory=SharedJobs(store, replica_id, reader=reader, budget=budget,
                                          plugin_limits=plugin_limits, stream_timeout_s=stream_timeout_s,
                                          **plan_options))
