"""Where a job's plans come from and where its shared state lives: the PlanSource protocol, and
LocalPlans, the single-node source (shared_job.py has the Redis one).

LocalPlans plans on demand (the first stream that needs step k plans it) and holds the plans from
the lowest step every rank may still resume at (the acknowledged step) to the planning frontier;
acknowledging drops the plans before it. ``state_dict()`` is what a restarted node needs to
continue at the acknowledged step without replanning from step 0: the planner's state at a
snapshot step at or before it (core/planner.py: taken every ``snapshot_every`` steps) and the
acknowledgements."""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from typing import Protocol

from disttrain_api.config import JobConfig
from disttrain_api.errors import DataQualityError, FeedbackDisabled, NotFoundError, ServiceUnavailableError
from preprocess_service.adapters.infra import metrics
from preprocess_service.core.feedback import CostRefitter, Observation, microbatch_features
from preprocess_service.core.packing import PackedSequence
from preprocess_service.core.planner import EpochPlanner, StepPlan
from preprocess_service.service.documents import JobDocuments
from preprocess_service.service.report import SkipLog, SkippedRecord, plan_balance
from preprocess_service.service.retention import MediaRetention

log = logging.getLogger(__name__)

STATE_VERSION = 2
"""2: the lineage, layout and acknowledged step (elastic resume); the planner state of core/planner.py."""
REPORT_WAIT_S = 30.0
"""How long a timing report waits for a step being planned."""


class Lease(Protocol):
    """One stream's hold on its rank."""

    def step_sent(self, step: int, num_microbatches: int) -> None:
        """Every microbatch of ``step`` went out (a shared lease raises StreamSuperseded when a
        newer stream of the same rank has started elsewhere)."""

    def close(self) -> None: ...


class PlanSource(Protocol):
    """A job's plans, acknowledgements, counters and skipped samples: in this process (LocalPlans)
    or in Redis for several replicas (shared_job.SharedPlans). The Job composes one."""

    def step_plan(self, step: int, stop: threading.Event | None = None) -> StepPlan | None:
        """The plan of ``step``, waiting for (or doing) its planning; None past the last step."""

    def plan_ahead(self) -> None:
        """Starts planning the first step a stream will ask for, in the background."""

    def num_steps(self) -> int:
        """Steps of the whole job, or -1 while planning has not reached the end."""

    def resolve(self, sequences: list[PackedSequence], epoch: int = 0) \
            -> tuple[list[PackedSequence], list[SkippedRecord]]:
        """Copies of planned sequences (of a step of ``epoch``) whose documents hold their encoded
        media, and the documents that could not be had again (reported)."""

    def taken(self, plan: StepPlan, rank: int, index: int) -> None:
        """The decoder took the media of one planned microbatch: its held bytes may go."""

    def held(self, step: int) -> StepPlan | None:
        """The plan of ``step`` if it is planned and held here, without planning or waiting."""

    def lost(self, records: list[SkippedRecord]) -> None:
        """Documents that failed while serving (their decode): into the job's report."""

    def open_lease(self, rank: int, start_step: int, stop: threading.Event) -> Lease: ...

    def acknowledge(self, rank: int, next_step: int) -> int:
        """``rank`` never resumes before ``next_step``; returns the lowest acknowledged step."""

    def report_timings(self, timings: list[tuple[int, int, int, float, float, float, float]]) -> dict: ...

    def report(self) -> dict: ...

    def close(self) -> None: ...


class RankLease:
    """A stream's hold on its rank in one process: it only reports the steps it sent."""

    def __init__(self, plans: LocalPlans, rank: int):
        self.plans, self.rank = plans, rank

    def step_sent(self, step: int, num_microbatches: int) -> None:
        self.plans.mark_sent(self.rank, step, num_microbatches)

    def close(self) -> None:
        pass


class LocalPlans:
    """Plans made in this process by one EpochPlanner, in a bounded window; thread-safe."""

    def __init__(self, config: JobConfig, documents: JobDocuments, retention: MediaRetention, skips: SkipLog,
                 *, retain_steps: int = 4, snapshot_every: int = 1):
        self.config, self.job_id = config, config.job_id()
        self.retention, self.skips = retention, skips
        self.planner = EpochPlanner(config, documents.dataset_urls, documents)
        self.refitter = CostRefitter(config.cost) if config.cost_feedback else None
        self.retain_steps = retain_steps
        """Planned steps whose encoded bytes stay in memory; older ones are re-read if a stream needs them
        (a rank that lags far behind, or never connects, cannot make the service hold the dataset)."""
        self.snapshot_every = snapshot_every
        self._lock = threading.Lock()
        self._planned = threading.Condition(self._lock)
        """Notified when a step was planned, planning ended or failed, or the planning lock was let go:
        a stream waiting for another stream's planning wakes at once, not at its next poll."""
        self._plan_lock = threading.Lock()
        self._plans: dict[int, StepPlan] = {}
        """Held plans by step: from ``_first_held`` to ``_next_step`` - 1."""
        self._first_held = 0
        self._next_step = 0
        self._snapshots: dict[int, dict] = {}
        """Planner states before every ``snapshot_every``-th step, from the newest one at or before
        the acknowledged step: what ``state_dict()`` resumes from."""
        self._planning_done = False
        self._closed = False
        self._failure: BaseException | None = None
        """Why planning stopped for good (too many bad samples, a bug); raised to every stream."""
        self._sent_through: dict[int, int] = defaultdict(lambda: -1)  # rank -> last step fully sent
        self._released_through = -1  # steps <= this hold no encoded bytes
        self._acked: dict[int, int] = {}
        self.num_sent_microbatches = 0
        self.num_planned_samples = 0

    # --- planning -------------------------------------------------------------------------
    def step_plan(self, step: int, stop: threading.Event | None = None) -> StepPlan | None:
        """Planning reads shards, so it runs under its own lock, never the plans' lock: reports,
        other streams' finished steps and other jobs never wait for a shard. A stream waiting for
        another stream's planning gives up when ``stop`` is set (it was cancelled)."""
        while True:
            with self._lock:
                if self._failure is not None:
                    raise self._failure
                if step < self._first_held:
                    raise NotFoundError(f"the plan of step {step} was dropped: every rank acknowledged step "
                                        f"{self._first_held} or later, so no rank may resume before it")
                if step < self._next_step or self._planning_done:
                    return self._plans.get(step)
            if not self._plan_lock.acquire(blocking=False):
                with self._lock:  # woken when the planner plans a step or lets the lock go
                    if step >= self._next_step and not self._planning_done and self._failure is None:
                        self._planned.wait(0.2)
                if stop is not None and stop.is_set():
                    raise ServiceUnavailableError(f"stopped while waiting for the plan of step {step}")
                continue
            try:
                self._plan_next()
            finally:
                self._plan_lock.release()
                with self._lock:
                    self._planned.notify_all()

    def plan_ahead(self) -> None:
        """Plans the first step a stream will ask for on a background thread, so the job's first
        microbatches need only their decoding when its ranks connect (their start-up, e.g. importing
        torch, overlaps the shard reads). A failure is kept for the streams, as when they plan."""
        def plan() -> None:
            try:
                self.step_plan(self._first_held)
            except Exception as exc:  # recorded in _failure (or the job was closed): streams report it
                log.debug("job %s: planning ahead stopped: %s", self.job_id, exc)

        threading.Thread(target=plan, daemon=True, name=f"plan-ahead:{self.job_id[:12]}").start()

    def _plan_next(self) -> None:
        """Plans one more step (caller holds the planning lock)."""
        with self._lock:
            if self._failure is not None or self._planning_done:
                return
        try:
            self._snapshot()
            plan = self.planner.next_plan()
            self._snapshot()  # the state at the frontier too: an acknowledgement there resumes exactly
        except Exception as exc:  # the planner is broken: every later call must see why
            with self._lock:
                self._failure = exc if isinstance(exc, DataQualityError) else \
                    RuntimeError(f"planning job {self.job_id} failed: {type(exc).__name__}: {exc}")
            raise
        with self._lock:
            if self._closed:  # closed while this step was read: the retention released every charge
                for doc in plan.documents() if plan is not None else ():
                    doc.media_bytes = None
                return
            if plan is None:
                self._planning_done = True
                return
            self._plans[plan.step] = plan
            self._next_step = plan.step + 1
            metrics.HELD_PLANS.labels(self.job_id).set(len(self._plans))
            self.num_planned_samples += sum(1 for _ in plan.documents())
            self._release_through(self._next_step - 1 - self.retain_steps)

    def _snapshot(self) -> None:
        """Keeps the planner's state before its next step (a few KB), every ``snapshot_every`` steps."""
        step = self.planner.step
        if step % self.snapshot_every == 0 and not self.planner.done and step not in self._snapshots:
            snapshot = self.planner.state_dict()
            with self._lock:
                self._snapshots[step] = snapshot

    def first_step(self) -> int:
        """The lowest step still held (a continued job's starting step)."""
        with self._lock:
            return self._first_held

    def num_steps(self) -> int:
        with self._lock:
            return self._next_step if self._planning_done else -1

    def num_held_plans(self) -> int:
        with self._lock:
            return len(self._plans)

    # --- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a restarted node needs to continue at the acknowledged step: versioned,
        JSON-serialisable, a few KB wherever in the epoch (the planner's state at that step)."""
        with self._lock:
            acked = min((self._acked.get(r, 0) for r in range(self.config.dp_size)), default=0)
            base = max((s for s in self._snapshots if s <= acked), default=None)
            return {"version": STATE_VERSION, "job_id": self.job_id, "lineage": self.config.lineage_id(),
                    "dp_size": self.config.dp_size, "acked_step": acked,
                    "acked": {str(r): s for r, s in self._acked.items()},
                    "snapshot_step": base, "planner": self._snapshots.get(base)}

    def load_state_dict(self, state: dict) -> None:
        """Continues from ``state`` (before any plan was made): the planner resumes at the snapshot
        step, so the acknowledged step is reached by planning at most ``snapshot_every`` steps.

        Elastic resume: a state of another job of this lineage (the same data and sequences, another
        layout: JobConfig.LAYOUT_FIELDS, e.g. dp_size 8 -> 6) continues at its acknowledged step,
        every rank of this layout from there, the planner taking the next ``global_batch`` sequences
        of the same stream. That needs the planner's state at exactly that step (ValueError if the
        state holds an earlier one only)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"job state version {state.get('version')!r} is not {STATE_VERSION}")
        elastic = state.get("job_id") != self.job_id
        if elastic and state.get("lineage") != self.config.lineage_id():
            raise ValueError(f"job state of job {state.get('job_id')!r} does not belong to job {self.job_id!r} "
                             "or its lineage (the same data with another layout)")
        if elastic and state["planner"] is None and state.get("acked_step"):
            raise ValueError(f"job state of job {state.get('job_id')!r} holds no planner state at its acknowledged "
                             f"step {state.get('acked_step')}: it cannot move to another layout")
        if elastic and state["planner"] is not None and state.get("snapshot_step") != state.get("acked_step"):
            raise ValueError(f"job state of job {state.get('job_id')!r} holds the planner at step "
                             f"{state.get('snapshot_step')}, not at its acknowledged step {state.get('acked_step')}: "
                             "it cannot move to another layout")
        with self._plan_lock:  # not the plans' lock: the planner charges re-read media under it
            if self._next_step:
                raise RuntimeError("load_state_dict() must be called before planning")
            if state["planner"] is not None:
                self.planner.load_state_dict(state["planner"])
            with self._lock:
                if elastic:
                    step = int(state["acked_step"])
                    self._acked = {r: step for r in range(self.config.dp_size)}
                    log.info("job %s continues job %s at step %d: dp_size %s -> %d", self.job_id,
                             state.get("job_id"), step, state.get("dp_size"), self.config.dp_size)
                else:
                    self._acked = {int(r): int(s) for r, s in state["acked"].items()}
                if state["planner"] is not None:
                    step = int(state["snapshot_step"])
                    self._snapshots = {step: state["planner"]}
                    self._first_held = self._next_step = step
                    self._released_through = step - 1
                    self._planning_done = self.planner.done

    # --- serving ------------------------------------------------------------------------------
    def resolve(self, sequences: list[PackedSequence], epoch: int = 0) \
            -> tuple[list[PackedSequence], list[SkippedRecord]]:
        return self.retention.with_bytes(sequences), []  # media are re-read by member: plugins never change them

    def held(self, step: int) -> StepPlan | None:
        with self._lock:
            return self._plans.get(step)

    def taken(self, plan: StepPlan, rank: int, index: int) -> None:
        for seq in plan.microbatch(rank, index):
            for doc in seq.documents:
                self.retention.drop(doc)

    def lost(self, records: list[SkippedRecord]) -> None:
        self.skips.add(records)

    def open_lease(self, rank: int, start_step: int, stop: threading.Event) -> RankLease:
        return RankLease(self, rank)

    def mark_sent(self, rank: int, step: int, num_microbatches: int) -> None:
        """A rank's whole step went out; drops bytes no rank still needs."""
        with self._lock:
            self.num_sent_microbatches += num_microbatches
            self._sent_through[rank] = max(self._sent_through[rank], step)
            self._release_through(min(self._sent_through[r] for r in range(self.config.dp_size)))

    def _release_through(self, step: int) -> None:
        """Drops the encoded bytes of every planned step <= ``step`` (caller holds the lock)."""
        step = min(step, self._next_step - 1)
        while self._released_through < step:
            self._released_through += 1
            plan = self._plans.get(self._released_through)
            for doc in plan.documents() if plan is not None else ():
                self.retention.drop(doc)

    # --- feedback, acknowledgements, report ----------------------------------------------------
    def report_timings(self, timings: list[tuple[int, int, int, float, float, float, float]]) -> dict:
        """Refits the cost model from measured (step, rank, microbatch, encoder_s, backbone_s,
        generator_s, total_s); the steps planned from now on are priced with it (feedback.py)."""
        if self.refitter is None:
            raise FeedbackDisabled(f"job {self.job_id} was opened without cost_feedback; its plans do not "
                                   "take measured timings")
        # a step being planned now finishes with the old prices first, so first_step_priced is exact
        if not self._plan_lock.acquire(timeout=REPORT_WAIT_S):
            raise ServiceUnavailableError(f"job {self.job_id} has been planning a step for {REPORT_WAIT_S:g} s "
                                          "(reading its shards); report the timings again")
        try:
            with self._lock:
                for step, rank, index, enc, bb, gen, total in timings:
                    if step in self._plans and 0 <= rank < self.config.dp_size \
                            and 0 <= index < self._plans[step].num_microbatches:
                        features = microbatch_features(self._plans[step].microbatch(rank, index))
                        self.refitter.add(Observation(features, (enc, bb, gen), total))
                self.planner.cost = self.refitter.refit()
                return {"cost": self.planner.cost, "num_observations": self.refitter.num_observations,
                        "first_step_priced": self._next_step, "errors": dict(self.refitter.errors)}
        finally:
            self._plan_lock.release()

    def acknowledge(self, rank: int, next_step: int) -> int:
        """Plans of steps every rank acknowledged are dropped (beyond the planning frontier only
        once planned), and so are snapshots older than the newest one at or before that step."""
        with self._lock:
            self._acked[rank] = max(self._acked.get(rank, 0), next_step)
            low = min(self._acked.get(r, 0) for r in range(self.config.dp_size))
            self._drop_before(low)
            metrics.HELD_PLANS.labels(self.job_id).set(len(self._plans))
        return low

    def _drop_before(self, step: int) -> None:
        """Drops held plans of steps < ``step`` and snapshots no resume can need (caller holds the lock)."""
        step = min(step, self._next_step)
        self._release_through(step - 1)
        for s in range(self._first_held, step):
            self._plans.pop(s, None)
        self._first_held = max(self._first_held, step)
        keep = max((s for s in self._snapshots if s <= step), default=None)
        for s in [s for s in self._snapshots if keep is not None and s < keep]:
            del self._snapshots[s]

    def report(self) -> dict:
        with self._lock:
            return {
                "skipped": self.skips.records(),
                "num_planned_samples": self.num_planned_samples,
                "num_planned_steps": self._next_step,
                "planning_done": self._planning_done,
                "num_sent_microbatches": self.num_sent_microbatches,
                "step_balance": [plan_balance(self._plans[s]) for s in sorted(self._plans)],
                "failure": "" if self._failure is None else str(self._failure),
                "datasets": self.planner.dataset_counts(),
            }

    def close(self) -> None:
        """Drops every plan and snapshot; planning stops."""
        with self._lock:
            self._closed = True
            for plan in self._plans.values():
                for doc in plan.documents():
                    self.retention.drop(doc)
            self._plans.clear()
            self._snapshots.clear()
            self._planning_done = True
