"""A job inside one service process: lazily planned steps in a bounded window, encoded media held
only while needed, the skipped-sample report, acknowledgements and counters. Thread-safe.

Plans live from the lowest step every rank may still resume at (the acknowledged step) to the
planning frontier; acknowledging drops the plans before it. ``state_dict()`` is what a restarted
node needs to continue at the acknowledged step without replanning from step 0: the planner's
state at a snapshot step at or before it (core/planner.py: taken every ``snapshot_every`` steps),
the acknowledgements and the counters."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from disttrain_api.config import MODALITIES, DatasetConfig, JobConfig
from disttrain_api.errors import (
    ConfigError,
    DataQualityError,
    FeedbackDisabled,
    NotFoundError,
    SampleError,
    ServiceUnavailableError,
)
from preprocess_service.adapters.decode import WORKER_DIED, Decoded, Decoder
from preprocess_service.adapters.infra import metrics
from preprocess_service.adapters.infra.budget import UNLIMITED, MemoryBudget
from preprocess_service.adapters.io import img2dataset, shards, sources
from preprocess_service.adapters.media import tokenizers as text_tokenizers
from preprocess_service.adapters.media.parse import parse_document
from preprocess_service.core.assemble import Layout, MicrobatchArrays, compact, finish, layout_microbatch
from preprocess_service.core.feedback import CostRefitter, Observation, microbatch_features
from preprocess_service.core.packing import PackedSequence
from preprocess_service.core.planner import EpochPlanner, StepPlan
from preprocess_service.core.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def expand_datasets(reader: shards.ShardReader, config: JobConfig) -> list[list[str]]:
    """Each dataset's checked, normalised shard names (JobConfig.mixture() order). ConfigError for
    a shard in two datasets (whose settings would it take?) or more names in all than the
    operator's max_shards."""
    out: list[list[str]] = []
    owner: dict[str, str] = {}
    total = 0
    for dataset in config.mixture():
        urls = reader.expand(dataset.shards)
        total += len(urls)
        if total > reader.policy.max_shards:
            raise ConfigError(f"the datasets expand to more than {reader.policy.max_shards} shards (max_shards)")
        for url in urls:
            if owner.setdefault(url, dataset.name) != dataset.name:
                raise ConfigError(f"shard {url!r} is in datasets {owner[url]!r} and {dataset.name!r}; "
                                  "a shard belongs to one dataset")
        out.append(urls)
    return out


def download_failures(url: str) -> list[SampleError]:
    """The rows img2dataset failed to download for a local shard (its parquet), as download_failed
    problems: reported once per shard and epoch, never in the tar, counted toward no tolerance.
    A manifest that cannot be read is a warning, never the job's end. A shard whose img2dataset
    stats file declares no failure is not read for them (img2dataset.declares_no_failures)."""
    try:
        if not sources.parse(url).is_local or img2dataset.declares_no_failures(url):
            return []
        manifest = img2dataset.read_manifest(url)
        return img2dataset.failed_rows_as_errors(manifest, url) if manifest is not None else []
    except MemoryError:
        raise
    except Exception as exc:  # the parquet is data: its faults are the shard's report, not the job's
        log.warning("shard %s: its img2dataset parquet cannot be used (%s: %s)", url, type(exc).__name__, exc)
        return []


def job_tokenizer(spec: str, policy) -> Tokenizer:
    """The job's tokenizer (text_tokenizers.load_checked); a file that cannot be used is a ConfigError."""
    try:
        return text_tokenizers.load_checked(spec, policy)
    except text_tokenizers.TokenizerError as exc:
        raise ConfigError(str(exc)) from None


def _parse_options(config: JobConfig, dataset: DatasetConfig):
    """(member kinds kept or None for all, ImageConfig, GenerationConfig) of one dataset."""
    modalities = None if set(dataset.modalities) == set(MODALITIES) else frozenset(dataset.modalities)
    generation = dataclasses.replace(config.generation, select=dataset.generate) if dataset.generate \
        else config.generation
    return modalities, dataset.image or config.image, generation


@dataclass(frozen=True, slots=True)
class SkippedRecord:
    key: str
    shard: str
    reason: str
    kind: str

    @property
    def record_id(self) -> str:
        """One record per lost sample (its key), per shard problem, and per dropped duplicate copy."""
        if not self.key:
            return f"<shard {self.shard}>"
        if self.kind in SampleError.NOT_LOST:
            return f"{self.key}\x00{self.kind}\x00{self.shard}"
        return self.key


@dataclass(slots=True)
class PendingMicrobatch:
    """A microbatch whose decoding is under way."""

    sequences: list[PackedSequence]
    layout: Layout
    future: Future
    skipped: list[SkippedRecord]
    """Planned documents that could not even be re-read (they are not in ``sequences``)."""


STATE_VERSION = 1
REPORT_WAIT_S = 30.0
"""How long a timing report waits for a step being planned."""
MANIFEST_DEFER_S = 10.0
"""Longest a job defers reading its first shards' img2dataset manifests for its first microbatch."""


class Job:
    """Plans on demand (the first stream that needs step k plans it; opening plans the first step
    ahead) and keeps the plans no rank has acknowledged yet; a document's encoded media bytes are
    dropped once its microbatch was handed to the decoder (or every rank was sent its step), and
    re-read from the shard if a resumed stream needs them again."""

    def __init__(self, config: JobConfig, tokenizer: Tokenizer | None = None, *, retain_steps: int = 4,
                 reader: shards.ShardReader = shards.DEFAULT_READER, shard_urls: list[list[str]] | None = None,
                 budget: MemoryBudget = UNLIMITED, snapshot_every: int = 16):
        self.config = config
        self.budget = budget
        """Encoded media kept from planning to decoding is charged to it; what does not fit is
        dropped at once and re-read from its shard when its microbatch is decoded."""
        self._media_held = 0
        self._largest_message = 0
        self.job_id = config.job_id()
        self.reader = reader.for_owner(self.job_id)
        """The server's reader, as this job: its share of the remote-shard cache (io/cache.py)."""
        self.dataset_urls = shard_urls if shard_urls is not None else expand_datasets(reader, config)
        """Each dataset's shard names (JobConfig.mixture() order)."""
        self.shard_urls = [url for urls in self.dataset_urls for url in urls]
        self._dataset_of = {url: i for i, urls in enumerate(self.dataset_urls) for url in urls}
        self._parse_options = [_parse_options(config, dataset) for dataset in config.mixture()]
        self.tokenizer = tokenizer or job_tokenizer(config.tokenizer, reader.policy)
        self.tokenizer_info = text_tokenizers.describe(self.tokenizer)
        """Ids, vocabulary size and file digest of the tokenizer (JobInfo.tokenizer)."""
        self._lock = threading.Lock()
        self._skipped: dict[str, SkippedRecord] = {}
        self._plans: dict[int, StepPlan] = {}
        """Held plans by step: from ``_first_held`` to ``_next_step`` - 1."""
        self._first_held = 0
        self._next_step = 0
        self.snapshot_every = snapshot_every
        self._snapshots: dict[int, dict] = {}
        """Planner states before every ``snapshot_every``-th step, from the newest one at or before
        the acknowledged step: what ``state_dict()`` resumes from."""
        self.planner = EpochPlanner(config, self.dataset_urls, self.reader, self._parse, self._record_skip,
                                    keep_media=self._keep_media, on_shard=self._shard_started,
                                    fingerprint=self.fingerprint)
        self.refitter = CostRefitter(config.cost) if config.cost_feedback else None
        self._planning_done = False
        self._sent_through: dict[int, int] = defaultdict(lambda: -1)  # rank -> last step fully sent
        self._released_through = -1  # steps <= this hold no encoded bytes
        self.retain_steps = retain_steps
        """Planned steps whose encoded bytes stay in memory; older ones are re-read if a stream needs them
        (a rank that lags far behind, or never connects, cannot make the service hold the dataset)."""
        self._acked: dict[int, int] = {}
        self._plan_lock = threading.Lock()
        self._planned = threading.Condition(self._lock)
        """Notified when a step was planned, planning ended or failed, or the planning lock was let go:
        a stream waiting for another stream's planning wakes at once, not at its next poll."""
        self.owner = ""
        """Identity (security.client_identity) of the client that opened the job."""
        self.clients: set[str] = set()
        """Identities that opened or joined it: only they may report timings or close it."""
        self.closed = threading.Event()
        self._stream_stops: set[threading.Event] = set()
        self._last_used = time.monotonic()
        self._failure: BaseException | None = None
        """Why planning stopped for good (too many bad samples, a bug); raised to every stream."""
        self.num_sent_microbatches = 0
        self.num_planned_samples = 0
        self.on_acknowledged: Callable[[int], None] | None = None
        """Called (outside the job's lock) when the lowest acknowledged step moves (JobRegistry saves the state)."""
        self._first_out = threading.Event()
        """Set when the job's first microbatch is decoded: img2dataset manifests wait for it."""
        self._manifests = threading.Condition()
        self._deferred_manifests: list[str] = []
        self._manifests_reading = 0
        self._manifests_deferred = True
        """Until the first microbatch is out (or a report is asked for), a shard's img2dataset
        manifest (its download failures) is read on a background thread afterwards: pyarrow's
        import and first read are a large share of the start-up, which would otherwise wait for them."""

    # --- planning -------------------------------------------------------------------------
    def step_plan(self, step: int, stop: threading.Event | None = None) -> StepPlan | None:
        """The plan of ``step``, planning up to it if needed; None past the last step.

        Planning reads shards, so it runs under its own lock, never the job's: reports, other
        streams' finished steps and other jobs never wait for a shard. A stream waiting for
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
            if self.planner.step % self.snapshot_every == 0 and not self.planner.done:
                snapshot = self.planner.state_dict()
                with self._lock:
                    self._snapshots[self.planner.step] = snapshot
            plan = self.planner.next_plan()
        except Exception as exc:  # the planner is broken: every later call must see why
            with self._lock:
                self._failure = exc if isinstance(exc, DataQualityError) else \
                    RuntimeError(f"planning job {self.job_id} failed: {type(exc).__name__}: {exc}")
            raise
        with self._lock:
            if self.closed.is_set():  # closed while this step was read: close() released every charge
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

    def _shard_started(self, url: str) -> None:
        with self._manifests:
            if self._manifests_deferred:
                self._deferred_manifests.append(url)
                if len(self._deferred_manifests) == 1:  # the first: one thread reads them all
                    threading.Thread(target=self._read_deferred_manifests, daemon=True,
                                     name=f"manifests:{self.job_id[:12]}").start()
                return
        for problem in download_failures(url):
            self._record_skip(problem)

    def _read_deferred_manifests(self) -> None:
        self._first_out.wait(MANIFEST_DEFER_S)
        self.flush_manifests()

    def flush_manifests(self, timeout_s: float = REPORT_WAIT_S) -> None:
        """Reads the manifests deferred at start-up (and stops deferring); returns once they are in
        the report, whoever reads them (or after ``timeout_s``)."""
        while True:
            with self._manifests:
                self._manifests_deferred = False
                if not self._deferred_manifests:
                    self._manifests.wait_for(lambda: self._manifests_reading == 0, timeout_s)
                    return
                url = self._deferred_manifests.pop(0)
                self._manifests_reading += 1
            try:
                for problem in download_failures(url):
                    self._record_skip(problem)
            finally:
                with self._manifests:
                    self._manifests_reading -= 1
                    self._manifests.notify_all()

    @property
    def fingerprint(self) -> str:
        """What the plans depend on besides the config: the tokenizer file's content. Saved with
        the planner's state; a state planned with another tokenizer file is refused."""
        return self.tokenizer_info["sha256"]

    def _parse(self, sample: dict):
        """A Document of ``sample`` with the settings of the dataset its shard belongs to."""
        url = sample.get("__url__", "")
        dataset = self._dataset_of.get(url)
        if dataset is None:  # a plan or a record naming a shard the job does not have: data too
            raise SampleError(sample.get("__key__", ""), f"shard {url!r} is not one of this job's", url, "shard_error")
        modalities, image, generation = self._parse_options[dataset]
        doc = parse_document(sample, image_config=image, tokenizer=self.tokenizer, seq_len=self.config.seq_len,
                             audio_config=self.config.audio, generation=generation, modalities=modalities)
        doc.dataset = dataset
        return doc

    def num_steps(self) -> int:
        """Steps of the whole job, or -1 while planning has not reached the end."""
        with self._lock:
            return self._next_step if self._planning_done else -1

    def num_held_plans(self) -> int:
        with self._lock:
            return len(self._plans)

    # --- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a restarted node needs to continue this job at its acknowledged step: versioned,
        JSON-serialisable, its size independent of the position in the epoch (but for the
        planner's key hashes, 8 bytes per sample read this epoch)."""
        with self._lock:
            acked = min((self._acked.get(r, 0) for r in range(self.config.dp_size)), default=0)
            base = max((s for s in self._snapshots if s <= acked), default=None)
            return {"version": STATE_VERSION, "job_id": self.job_id,
                    "acked": {str(r): s for r, s in self._acked.items()},
                    "snapshot_step": base, "planner": self._snapshots.get(base)}

    def load_state_dict(self, state: dict) -> None:
        """Continues from ``state`` (before any plan was made): the planner resumes at the snapshot
        step, so the acknowledged step is reached by planning at most ``snapshot_every`` steps."""
        if state.get("version") != STATE_VERSION or state.get("job_id") != self.job_id:
            raise ValueError(f"job state (version {state.get('version')}, job {state.get('job_id')!r}) does not "
                             f"belong to job {self.job_id!r} version {STATE_VERSION}")
        with self._plan_lock:  # not the job's lock: the planner charges re-read media under it
            if self._next_step:
                raise RuntimeError("load_state_dict() must be called before planning")
            if state["planner"] is not None:
                self.planner.load_state_dict(state["planner"])
            with self._lock:
                self._acked = {int(r): int(s) for r, s in state["acked"].items()}
                if state["planner"] is not None:
                    step = int(state["snapshot_step"])
                    self._snapshots = {step: state["planner"]}
                    self._first_held = self._next_step = step
                    self._released_through = step - 1
                    self._planning_done = self.planner.done

    def plan_all(self) -> int:
        """Plans every step (reads every shard once); returns the number of steps."""
        step = 0
        while self.step_plan(step) is not None:
            step += 1
        return step

    def _record_skip(self, exc: SampleError) -> None:
        record = SkippedRecord(exc.key, exc.shard, exc.reason, exc.kind)
        with self._lock:
            if record.record_id not in self._skipped:
                metrics.DECODE_ERRORS.labels(exc.kind, "plan").inc()
            self._skipped.setdefault(record.record_id, record)

    # --- streaming ------------------------------------------------------------------------
    def check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.config.dp_size:
            raise ConfigError(f"dp_rank {rank} is outside this job's dp_size {self.config.dp_size}")

    def start_microbatch(self, plan: StepPlan, rank: int, index: int, decoder: Decoder,
                         stop: threading.Event | None = None) -> PendingMicrobatch:
        """Lays out one microbatch of ``rank`` and submits its decoding to ``decoder`` (adapters/decode/),
        which may wait for room in the memory budget until ``stop`` is set."""
        sequences, skipped = self._resolve(plan.microbatch(rank, index))
        layout = self._layout(sequences)
        future = decoder.submit(layout, stop)
        for seq in sequences:  # copies of the plan's documents: the decoder has taken their bytes already
            for doc in seq.documents:
                doc.media_bytes = None
        with self._lock:  # and so has it the plan's: a stream that needs them again re-reads them
            for seq in plan.microbatch(rank, index):
                for doc in seq.documents:
                    if getattr(doc, "media_bytes", None) is not None:  # SharedJob's plans hold references only
                        self._drop_media(doc)
        return PendingMicrobatch(sequences, layout, future, skipped)

    def finish_microbatch(self, pending: PendingMicrobatch) -> tuple[MicrobatchArrays, Callable[[], None],
                                                                      Callable | None]:
        """Waits for the decode; returns the arrays (views of the decode buffer), the function
        that releases that buffer once the arrays are no longer needed, and the decoder's lend
        (Decoded.lend: None where the buffer cannot be lent to a client). Documents that failed to
        decode are left out, reported in ``arrays.skipped`` and recorded in the job's report."""
        decoded: Decoded = pending.future.result()
        layout, buffer, release, lend = pending.layout, decoded.buffer, decoded.release, decoded.lend
        if decoded.errors:
            survivors = self._layout(pending.sequences, skip=frozenset(decoded.errors))
            buffer = compact(layout, buffer, survivors)
            decoded.release()
            layout, release, lend = survivors, (lambda: None), None
        arrays = finish(layout, buffer)
        self._first_out.set()
        shards_of = {doc.key: doc.shard for seq in pending.sequences for doc in seq.documents}
        arrays.skipped.extend(pending.skipped)
        failed = [SkippedRecord(key, shards_of[key], f"decode failed: {reason}",
                                "decode_worker_died" if reason.startswith(WORKER_DIED) else "decode_failed")
                  for key, reason in decoded.errors.items()]
        arrays.skipped.extend(failed)
        with self._lock:
            for record in failed:
                self._skipped.setdefault(record.record_id, record)
        if failed:
            self._share_skips(failed)
        return arrays, release, lend

    def _share_skips(self, records: list[SkippedRecord]) -> None:
        """Where other replicas must see skips found while serving (SharedJob: Redis); here, nowhere."""

    def microbatch(self, plan: StepPlan, rank: int, index: int, decoder) -> MicrobatchArrays:
        """One microbatch decoded and copied out of the decode buffer (for tests and tools)."""
        arrays, release, _ = self.finish_microbatch(self.start_microbatch(plan, rank, index, decoder))
        arrays.arrays = {name: np.array(a) for name, a in arrays.arrays.items()}
        release()
        return arrays

    def _layout(self, sequences: list[PackedSequence], skip: frozenset[str] = frozenset()) -> Layout:
        return layout_microbatch(sequences, seq_len=self.config.seq_len, tokenizer=self.tokenizer,
                                 audio_config=self.config.audio, skip=skip)

    def _resolve(self, sequences: list[PackedSequence]) -> tuple[list[PackedSequence], list[SkippedRecord]]:
        """The planned sequences with their documents' encoded bytes, and documents that were lost."""
        return self._with_bytes(sequences), []

    def _with_bytes(self, sequences: list[PackedSequence]) -> list[PackedSequence]:
        """Copies of the sequences whose documents hold their encoded images: a snapshot taken under
        the lock (a concurrent release cannot pull bytes from under the decoder), and bytes that were
        already released re-read from their shards."""
        with self._lock:
            snapshot = [[(doc, doc.media_bytes) for doc in seq.documents] for seq in sequences]
        missing: dict[str, set[str]] = defaultdict(set)
        for doc, data in (pair for seq in snapshot for pair in seq):
            if data is None and doc.media:
                missing[doc.shard].add(doc.key)
        fetched: dict[tuple[str, str], dict] = {}  # by (shard, key): datasets may reuse keys
        for url, keys in missing.items():
            fetched.update(((url, key), sample) for key, sample in self.reader.read_samples(url, keys).items())
        out = []
        for seq, pairs in zip(sequences, snapshot):
            documents = []
            for doc, data in pairs:
                if data is None and doc.media:
                    sample = fetched.get((doc.shard, doc.key), {})
                    data = {m.member: sample[m.member] for m in doc.media if m.member in sample}
                documents.append(dataclasses.replace(doc, media_bytes=data))
            out.append(dataclasses.replace(seq, documents=documents))
        return out

    def open_stream(self, rank: int, start_step: int, stop: threading.Event) -> StreamLease:
        """Registers a stream of ``rank``; the server reports each step it finishes to the lease."""
        return StreamLease(self, rank)

    def note_message_bytes(self, nbytes: int) -> None:
        """The size of a microbatch message sent; the largest so far sizes new streams' admission."""
        self._largest_message = max(self._largest_message, nbytes)

    def stream_estimate(self, prefetch: int) -> int:
        """Bytes a stream of this job may hold: two microbatches in decode (each a shared-memory
        arena rounded up to a power of two, with room for the encoded inputs) plus a media-free
        one (streams.py lets it pass the decode slots: one minimal arena), ``prefetch`` prepared
        messages, and two with gRPC (the one being sent and gRPC's copy of the one before).
        Sized by the largest message seen, or before any by the config's bound."""
        per = self._largest_message or self.config.max_microbatch_bytes()
        minimal = 1 << 22
        arena = max(minimal, 1 << (int(per * 1.5) - 1).bit_length())
        return 2 * arena + minimal + (prefetch + 2) * per

    # --- lifecycle --------------------------------------------------------------------------
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
        stops (SharedJob's planner thread). Returns the number of streams it ended."""
        with self._lock:
            self.closed.set()
            stops = list(self._stream_stops)
            for plan in self._plans.values():
                for doc in plan.documents():
                    self._drop_media(doc)
            self._plans.clear()
            self._snapshots.clear()
            self._planning_done = True
            # documents the planner still held (shuffle buffer, open sequences) go with it
            self.budget.release_cache(self._media_held)
            self._media_held = 0
        for stop in stops:
            stop.set()
        return len(stops)

    def mark_sent(self, rank: int, step: int, num_microbatches: int) -> None:
        """Called after a rank's whole step went out; drops bytes no rank still needs."""
        with self._lock:
            self.num_sent_microbatches += num_microbatches
            self._sent_through[rank] = max(self._sent_through[rank], step)
            self._release_through(min(self._sent_through[r] for r in range(self.config.dp_size)))

    def _keep_media(self, doc) -> bool:
        """Called by the planner for every parsed document: may it keep its encoded bytes? Not one
        of a local uncompressed tar: its bytes are read again by ``pread`` when its microbatch is
        decoded (ShardReader.rereads_cheaply), and holding them from planning to decoding (the
        shuffle buffer, the packer and the planned steps) was the server's largest heap item in
        bench/peers.py. The others are held while the memory budget has room."""
        if self.reader.rereads_cheaply(doc.shard):
            return False
        nbytes = _media_nbytes(doc)
        if self.closed.is_set() or not self.budget.try_cache(nbytes):
            return False
        with self._lock:
            if self.closed.is_set():  # close() released what was held; this charge would leak
                self.budget.release_cache(nbytes)
                return False
            self._media_held += nbytes
        return True

    def _drop_media(self, doc) -> None:
        """Drops a document's encoded bytes and their charge (caller holds the lock)."""
        if doc.media_bytes is not None:
            nbytes = _media_nbytes(doc)
            doc.media_bytes = None
            self._media_held -= nbytes
            self.budget.release_cache(nbytes)

    def _release_through(self, step: int) -> None:
        """Drops the encoded bytes of every planned step <= ``step`` (caller holds the lock)."""
        step = min(step, self._next_step - 1)
        while self._released_through < step:
            self._released_through += 1
            plan = self._plans.get(self._released_through)
            for doc in plan.documents() if plan is not None else ():
                self._drop_media(doc)

    # --- feedback ----------------------------------------------------------------------------
    def report_timings(self, timings: list[tuple[int, int, int, float, float, float]]) -> dict:
        """Refits the cost model from measured (step, rank, microbatch, encoder_s, backbone_s,
        generator_s); the steps planned from now on are priced with it (feedback.py)."""
        if self.refitter is None:
            raise FeedbackDisabled(f"job {self.job_id} was opened without cost_feedback; its plans do not "
                                   "take measured timings")
        # a step being planned now finishes with the old prices first, so first_step_priced is exact
        if not self._plan_lock.acquire(timeout=REPORT_WAIT_S):
            raise ServiceUnavailableError(f"job {self.job_id} has been planning a step for {REPORT_WAIT_S:g} s "
                                          "(reading its shards); report the timings again")
        try:
            with self._lock:
                for step, rank, index, *seconds in timings:
                    if step in self._plans and 0 <= rank < self.config.dp_size \
                            and 0 <= index < self._plans[step].num_microbatches:
                        features = microbatch_features(self._plans[step].microbatch(rank, index))
                        self.refitter.add(Observation(features, tuple(seconds)))
                self.planner.cost = self.refitter.refit()
                return {"cost": self.planner.cost, "num_observations": self.refitter.num_observations,
                        "first_step_priced": self._next_step, "errors": dict(self.refitter.errors)}
        finally:
            self._plan_lock.release()

    # --- acknowledgements and report -------------------------------------------------------
    def acknowledge(self, rank: int, next_step: int) -> int:
        """``rank`` checkpointed its state before ``next_step``: it never resumes before it. Plans of
        steps every rank acknowledged are dropped (beyond the planning frontier only once planned),
        and so are snapshots older than the newest one at or before that step."""
        self.check_rank(rank)
        with self._lock:
            before = min(self._acked.get(r, 0) for r in range(self.config.dp_size))
            self._acked[rank] = max(self._acked.get(rank, 0), next_step)
            low = min(self._acked.get(r, 0) for r in range(self.config.dp_size))
            self._drop_before(low)
            metrics.HELD_PLANS.labels(self.job_id).set(len(self._plans))
            metrics.ACKED_STEP.labels(self.job_id).set(low)
        if low > before and self.on_acknowledged is not None:
            self.on_acknowledged(low)
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
        self.flush_manifests()
        with self._lock:
            return {
                "skipped": list(self._skipped.values()),
                "num_planned_samples": self.num_planned_samples,
                "num_planned_steps": self._next_step,
                "planning_done": self._planning_done,
                "num_sent_microbatches": self.num_sent_microbatches,
                "step_balance": [plan_balance(self._plans[s]) for s in sorted(self._plans)],
                "failure": "" if self._failure is None else str(self._failure),
                "datasets": self.planner.dataset_counts(),
            }


def _save_state(job: Job, path: Path, lock: threading.Lock, _low: int) -> None:
    """Writes the job's state next to ``path`` and renames it over ``path`` (never half written)."""
    with lock:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(job.state_dict()))
        os.replace(tmp, path)


def _media_nbytes(doc) -> int:
    return sum(len(b) for b in (doc.media_bytes or {}).values())


class StreamLease:
    """One stream's hold on its rank (in one process there is nothing to hold)."""

    def __init__(self, job: Job, rank: int):
        self.job, self.rank = job, rank

    def step_sent(self, step: int, num_microbatches: int) -> None:
        """Every microbatch of ``step`` went out. SharedJob's lease raises StreamSuperseded here
        when a newer stream of the same rank has started elsewhere."""
        self.job.mark_sent(self.rank, step, num_microbatches)

    def close(self) -> None:
        pass


def plan_balance(plan: StepPlan) -> dict:
    imbalance, arrival = plan.imbalance()
    return {"step": plan.step, "imbalance": imbalance, "arrival_imbalance": arrival,
            "rank_load_s": plan.rank_loads().tolist(), **plan.simulation,
            "num_sequences": sum(1 for seq in plan.sequences if seq.documents),
            "num_samples": sum(1 for _ in plan.documents())}


class JobRegistry:
    """Open jobs by id; opening an identical config returns the same job.

    With ``state_dir``, every acknowledgement that moves a job's lowest acknowledged step writes
    the job's state (``Job.state_dict()``) to ``state_dir/JOB_ID.json`` (atomically), and a job
    opened again (the same config, after a restart of this node) continues from it: at the
    acknowledged step, planning at most ``snapshot_every`` steps, not from step 0."""

    def __init__(self, budget: MemoryBudget = UNLIMITED, state_dir: str | Path | None = None):
        self._lock = threading.Lock()
        self._jobs: dict[str, Job] = {}
        self.budget = budget
        self.state_dir = Path(state_dir) if state_dir else None
        if self.state_dir is not None:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        self.plan_ahead = True
        """A job opened here plans its first step at once (Job.plan_ahead); False: at its first stream."""

    def open(self, config: JobConfig, *, shard_urls: list[list[str]] | None = None,
             reader: shards.ShardReader = shards.DEFAULT_READER, client: str = "") -> Job:
        """The open job of ``config``, opened if need be (``client`` becomes its owner) and joined by
        ``client``; its shards are expanded before the lock is taken (an expansion can take a
        while; nothing else waits for it)."""
        job_id = config.job_id()
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            job = self._new_job(config, reader, shard_urls)
            job.owner = client
            created = job
        else:
            created = None
        with self._lock:
            job = self._jobs.setdefault(job_id, job)
            job.clients.add(client)
        if job is created and self.plan_ahead:
            job.plan_ahead()
        job.touch()
        return job

    def _new_job(self, config: JobConfig, reader: shards.ShardReader, shard_urls: list[list[str]] | None) -> Job:
        job = Job(config, reader=reader, shard_urls=shard_urls, budget=self.budget)
        if self.state_dir is not None:
            path = self.state_dir / f"{job.job_id}.json"
            job.on_acknowledged = functools.partial(_save_state, job, path, threading.Lock())
            try:
                state = json.loads(path.read_text())
            except FileNotFoundError:
                state = None
            except (OSError, ValueError) as exc:
                log.warning("job %s: ignoring its saved state %s (%s); planning from step 0", job.job_id, path, exc)
                state = None
            if state is not None:
                try:
                    job.load_state_dict(state)
                    log.info("job %s: resumed from %s at step %s", job.job_id, path, state.get("snapshot_step"))
                except (ValueError, KeyError, TypeError) as exc:  # e.g. planned with another tokenizer file
                    log.warning("job %s: cannot resume from %s (%s); planning from step 0", job.job_id, path, exc)
                    return self._new_job_without_state(config, reader, shard_urls, path)
        return job

    def _new_job_without_state(self, config: JobConfig, reader: shards.ShardReader,
                               shard_urls: list[list[str]] | None, path: Path) -> Job:
        job = Job(config, reader=reader, shard_urls=shard_urls, budget=self.budget)
        job.on_acknowledged = functools.partial(_save_state, job, path, threading.Lock())
        return job

    def close_job(self, job_id: str) -> int:
        """Closes and forgets a job; returns the number of streams that were ended."""
        with self._lock:
            job = self._jobs.pop(job_id, None)
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
                self.close_job(job_id)
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

    def is_open(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._jobs

    def get(self, job_id: str) -> Job:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            raise NotFoundError(f"no open job with id {job_id!r}; call OpenJob first")
        job.touch()
        return job

    def close(self) -> None:
        """Closes every job (server shutdown)."""
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            job.close()
