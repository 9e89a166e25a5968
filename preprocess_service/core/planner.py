"""Deterministic, resumable planning of a job: shards -> documents -> packed sequences -> step plans.

Hook order for every epoch: shard order (seeded) -> read (a DocumentSource) -> parse (priced from
metadata, bad samples skipped) -> shuffle buffer (seeded) -> pack -> price -> group B sequences
into a global batch -> the job's batch planner (reorder.PLANNERS: which rank, which
microbatch, which order) -> StepPlan. The plan of step k is a function of the JobConfig and the
data alone, so it can be rebuilt anywhere.

The planner is a state machine, not a generator: ``state_dict()`` between two steps holds where
it stands (epoch, step, shard cursor, the shuffle buffer's and the packer's documents as
references, the shuffle generator, error counters, the keys read this epoch as 8-byte hashes and
the cost coefficients), and ``load_state_dict()`` continues from there on any node: the next plan
equals the one the original planner would have made, with no replanning from step 0. Its cost
does not grow with the position in the epoch, except the key hashes (8 bytes per sample read this
epoch, for duplicate detection). Pure: samples are read and parsed through one injected
DocumentSource (the service's is service/documents.py: shards, the job's parse settings, which
documents keep their encoded bytes, the shards' side files).

The last global batch of an epoch may be short: it gets ceil(n / (D*S)) microbatches per rank,
padded with empty sequences, so every sample is delivered (no drop_last).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from disttrain_api.config import JobConfig
from disttrain_api.errors import ConfigError, DataQualityError, SampleError
from preprocess_service.core import reorder
from preprocess_service.core.feedback import REFIT_FIELDS as COST_FIELDS
from preprocess_service.core.mixture import Blend, DatasetCursor, epoch_over
from preprocess_service.core.packing import PackedSequence, Packer, price
from preprocess_service.core.reorder.instance import PLANNERS, Instance, evaluate
from preprocess_service.core.sample import NEXT_OFFSET, Document

SkipSink = Callable[[SampleError], None]
Parse = Callable[[dict], Document]
"""Turns a raw sample (``__key__``, ``__url__``, member -> bytes) into a Document or raises SampleError."""

STATE_VERSION = 2
"""2: a cursor, key hashes and counts per dataset of the mixture (1: one dataset, still read)."""
MAX_SEEN_BYTES = 8 << 27
"""Key hashes a loaded state may hold: 134 million keys (a stored state is data too)."""


class SampleSource(Protocol):
    """Where samples come from (adapters/io/shards.ShardReader)."""

    def iter_shard(self, url: str, on_problem: SkipSink, start: dict | None = None) -> Iterator[dict]:
        """Raw samples of one shard, from ``start`` (a cursor: {"samples": n, "offset": bytes or None})."""

    def read_samples(self, url: str, keys: set[str]) -> dict[str, dict]:
        """The raw samples of ``keys`` in one shard; keys that cannot be read are missing."""


class DocumentSource(SampleSource, Protocol):
    """Everything the planner reads through: a shard's samples from a cursor, samples by key, a
    sample parsed into a Document, and where skipped samples go. What the source does around
    that (reading a shard's side files when a pass starts it, deciding which documents keep their
    encoded bytes until they are decoded) is its own business, not the planner's."""

    fingerprint: str
    """What else the plans depend on (the tokenizer file's digest): saved in the state, and a
    state with another one is refused, since it was planned with other token counts."""

    def parse(self, sample: dict) -> Document:
        """A Document of a raw sample (``__key__``, ``__url__``, member -> bytes), or SampleError."""

    def skipped(self, problem: SampleError) -> None:
        """A sample (or a shard) was skipped: the job's report."""


@dataclass(slots=True)
class Documents:
    """A DocumentSource from parts (tests, benches, tools): samples from ``samples``, parsed by
    ``parse``, skips to ``on_skip``; every document keeps its bytes."""

    samples: SampleSource
    parse: Parse
    on_skip: SkipSink = lambda problem: None
    fingerprint: str = ""

    def iter_shard(self, url: str, on_problem: SkipSink, start: dict | None = None) -> Iterator[dict]:
        return self.samples.iter_shard(url, on_problem, start)

    def read_samples(self, url: str, keys: set[str]) -> dict[str, dict]:
        return self.samples.read_samples(url, keys)

    def skipped(self, problem: SampleError) -> None:
        self.on_skip(problem)


@dataclass(slots=True)
class StepPlan:
    """One global batch and who trains on what, in which order."""

    step: int
    epoch: int
    sequences: list[PackedSequence]
    assignment: np.ndarray
    """int[D, M, S]: sequence indices per rank, microbatches in execution order."""
    baseline_assignment: np.ndarray
    """The same batch with no reordering, for reporting what reordering bought."""
    simulation: dict
    """iteration_s, arrival_iteration_s, lower_bound_s: the exact 1F1B simulator's verdict on the
    plan and on the arrival order, and the batch's lower bound (cost-model seconds);
    bubble_fraction: the predicted idle share of the ranks' stages."""

    @property
    def num_microbatches(self) -> int:
        return int(self.assignment.shape[1])

    def microbatch(self, rank: int, index: int) -> list[PackedSequence]:
        return [self.sequences[i] for i in self.assignment[rank, index]]

    def documents(self) -> Iterator[Document]:
        for seq in self.sequences:
            yield from seq.documents

    def costs(self) -> np.ndarray:
        return np.array([seq.cost.total_s for seq in self.sequences])

    def rank_loads(self) -> np.ndarray:
        """float[D]: each rank's summed sequence cost with the planned assignment."""
        return self.costs()[self.assignment].sum(axis=(1, 2))

    def imbalance(self) -> tuple[float, float]:
        """(max/mean rank load with reordering, the same without)."""
        costs = self.costs()
        return reorder.imbalance(costs, self.assignment), reorder.imbalance(costs, self.baseline_assignment)



class EpochPlanner:
    """Plans a job's steps in order (``next_plan()``) from what ``source`` reads and parses; skipped
    samples go to ``source.skipped``."""

    def __init__(self, config: JobConfig, shard_urls: list[list[str]] | list[str], source: DocumentSource):
        """``shard_urls``: each dataset's shard names, in ``config.mixture()`` order (a flat list is
        the one dataset of a plain job)."""
        self.config = config
        if config.reorder_algorithm not in PLANNERS:
            raise ConfigError(f"unknown reorder_algorithm {config.reorder_algorithm!r}; this server has "
                              f"{sorted(PLANNERS)}")
        self.dataset_urls: list[list[str]] = \
            [list(urls) for urls in shard_urls] if shard_urls and not isinstance(shard_urls[0], str) \
            else [list(shard_urls)]  # type: ignore[arg-type]
        if len(self.dataset_urls) != len(config.mixture()):
            raise ValueError(f"{len(self.dataset_urls)} shard lists for {len(config.mixture())} datasets")
        self.totals = np.zeros((len(self.dataset_urls), 2), dtype=np.int64)
        """Documents and tokens drawn from each dataset over all epochs."""
        self.source = source
        self.fingerprint = source.fingerprint
        self.cost = config.cost
        """Coefficients the next sequences are priced with (feedback.py may replace them mid-job)."""
        self.done = False
        self._start_epoch(0, 0)

    # --- state ---------------------------------------------------------------------------------
    def _start_epoch(self, epoch: int, step: int) -> None:
        cfg = self.config
        self.epoch, self.step = epoch, step
        self._cursors = [DatasetCursor(urls, i) for i, urls in enumerate(self.dataset_urls)]
        for cursor in self._cursors:
            cursor.start_pass(cfg, epoch, 0)
        self._blend = Blend.of(cfg)
        self._epoch_docs = 0
        self._rng = np.random.default_rng([cfg.seed, epoch, 0xD15])
        self._buffer: list[Document] = []
        self._packer = Packer(cfg.seq_len, cfg.pack_window)
        self._ready: list[PackedSequence] = []
        self._drained = False
        self._tolerance = ErrorTolerance(cfg.max_consecutive_errors, cfg.max_error_fraction)
        self._seen = [KeySet() for _ in self._cursors]
        """Hashes of the keys read in each dataset's current pass (keys repeat across datasets)."""

    def state_dict(self) -> dict:
        """Where planning stands between two steps: small, JSON-serialisable, versioned."""
        def refs(docs):
            return [[doc.shard, doc.key] for doc in docs]

        return {
            "version": STATE_VERSION, "fingerprint": self.fingerprint,
            "epoch": self.epoch, "step": self.step, "done": self.done,
            "datasets": [{**cursor.state_dict(), "seen": _pack_hashes(seen)}
                         for cursor, seen in zip(self._cursors, self._seen)],
            "blend": self._blend.counts.tolist(), "epoch_docs": self._epoch_docs, "totals": self.totals.tolist(),
            "rng": self._rng.bit_generator.state,
            "buffer": refs(self._buffer),
            "packer": [refs(seq.documents) for seq in self._packer.open],
            "ready": [refs(seq.documents) for seq in self._ready],
            "drained": self._drained,
            "tolerance": [self._tolerance.consecutive, self._tolerance.bad, self._tolerance.total],
            "cost": {name: getattr(self.cost, name) for name in COST_FIELDS},
        }

    def load_state_dict(self, state: dict) -> None:
        """Continues from ``state``: the documents it names are re-read (by key) and re-parsed,
        so resuming costs about one shuffle buffer of reads wherever in the epoch it happens."""
        version = state.get("version") if isinstance(state, dict) else state
        if version == 1:  # one dataset: its cursor and key hashes at the top level
            state = {**state, "datasets": [{**state["cursor"], "seen": state["seen"]}],
                     "blend": [0], "epoch_docs": 0, "totals": [[0, 0]]}
        elif version != STATE_VERSION:
            raise ValueError(f"planner state version {version!r} is not {STATE_VERSION}")
        if len(state["datasets"]) != len(self._cursors) or len(state["blend"]) != len(self._cursors):
            raise ValueError(f"planner state of {len(state['datasets'])} datasets, this job has {len(self._cursors)}")
        saved = state.get("fingerprint", "")
        if saved != self.fingerprint:
            raise ValueError(f"planner state planned with tokenizer file {saved[:12] or 'byte'!r}, this job's is "
                             f"{self.fingerprint[:12] or 'byte'!r}: the file changed, so would the plans")
        self._start_epoch(int(state["epoch"]), int(state["step"]))
        self.done = bool(state["done"])
        room = MAX_SEEN_BYTES  # one bound over every dataset's key hashes
        for i, (cursor, saved) in enumerate(zip(self._cursors, state["datasets"])):
            cursor.load_state_dict(saved, self.config, self.epoch)
            hashes = _unpack_hashes(saved["seen"], room)
            room -= hashes.nbytes
            self._seen[i] = KeySet(hashes)
        self._blend.counts = np.array(state["blend"], dtype=np.int64)
        self._epoch_docs = int(state["epoch_docs"])
        self.totals = np.array(state["totals"], dtype=np.int64).reshape(len(self._cursors), 2)
        self._rng.bit_generator.state = state["rng"]
        self._drained = bool(state["drained"])
        t = state["tolerance"]
        self._tolerance.consecutive, self._tolerance.bad, self._tolerance.total = (int(x) for x in t)
        self.cost = dataclasses.replace(self.config.cost, **state["cost"])
        wanted = [*state["buffer"], *(r for seq in state["packer"] for r in seq),
                  *(r for seq in state["ready"] for r in seq)]
        docs = self._reread(wanted)

        def pick(ref_list):
            return [docs[tuple(ref)] for ref in ref_list if tuple(ref) in docs]

        self._buffer = pick(state["buffer"])
        self._packer.open = [PackedSequence(seq_len=self.config.seq_len, documents=pick(refs))
                             for refs in state["packer"]]
        self._ready = [PackedSequence(seq_len=self.config.seq_len, documents=pick(refs)) for refs in state["ready"]]

    def _reread(self, refs: list) -> dict[tuple[str, str], Document]:
        by_shard: dict[str, set[str]] = {}
        for shard, key in refs:
            by_shard.setdefault(shard, set()).add(key)
        docs = {}
        for shard, keys in by_shard.items():
            found = self.source.read_samples(shard, keys)
            for key in keys:
                sample = found.get(key)
                if sample is None:
                    self.source.skipped(SampleError(key, "could not be re-read when planning resumed (the shard "
                                                    "changed or cannot be read)", shard, "resume_reread"))
                    continue
                doc = self._parse(sample, shard)
                if doc is not None:
                    docs[(shard, key)] = doc
        return docs

    # --- planning ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[StepPlan]:
        while (plan := self.next_plan()) is not None:
            yield plan

    def next_plan(self) -> StepPlan | None:
        """The plan of step ``self.step``, or None once every epoch is planned."""
        cfg = self.config
        while not self.done:
            while len(self._ready) < cfg.global_batch and self._advance():
                pass
            if self._ready:
                batch, self._ready = self._ready[:cfg.global_batch], self._ready[cfg.global_batch:]
                for seq in batch:  # priced now: a refit between two steps prices every later step
                    seq.cost = price(seq, self.cost)
                plan = self._plan_batch(batch, self.step, self.epoch)
                self.step += 1
                if self._drained and not self._ready:
                    self._next_epoch()
                return plan
            self._next_epoch()
        return None

    def _next_epoch(self) -> None:
        if self.epoch + 1 >= self.config.num_epochs:
            self.done = True
        else:
            self._start_epoch(self.epoch + 1, self.step)

    def _advance(self) -> bool:
        """Moves one document through the shuffle buffer and the packer; False once the epoch's
        documents are all packed (the open sequences are then ready too)."""
        if self._drained:
            return False
        size = self.config.shuffle_buffer
        doc = self._next_document()
        out: Document | None
        if doc is not None and size <= 1:
            out = doc
        elif doc is not None:
            self._buffer.append(doc)
            out = self._pop() if len(self._buffer) >= size else None
        elif self._buffer:
            out = self._pop()
        else:
            self._emit(self._packer.flush())
            self._drained = True
            return False
        if out is not None:
            self._emit(self._packer.add(out))
        return True

    def _pop(self) -> Document:
        buffer = self._buffer
        index = int(self._rng.integers(len(buffer)))
        buffer[index], buffer[-1] = buffer[-1], buffer[index]
        return buffer.pop()

    def _emit(self, sequences: list[PackedSequence]) -> None:
        self._ready.extend(sequences)

    def _problem(self, exc: SampleError) -> None:
        self.source.skipped(exc)
        if exc.kind not in SampleError.NOT_LOST:
            self._tolerance.failed(exc)

    def _next_document(self) -> Document | None:
        """The epoch's next document, from the dataset the blend picks (core/mixture.py); None once
        the epoch is over by the job's rule. A dataset that runs out is restarted (a new pass) or
        ends the epoch, by mix_epoch / mix_epoch_samples."""
        cfg = self.config
        while not epoch_over(cfg, self._cursors, None, self._epoch_docs):
            live = np.array([not c.dead for c in self._cursors])
            index = self._blend.choose(live)
            cursor = self._cursors[index]
            doc = self._read_from(cursor)
            if doc is not None:
                cursor.pass_docs += 1
                cursor.epoch_docs += 1
                self._blend.record(index, doc.num_tokens)
                self._epoch_docs += 1
                self.totals[index] += (1, doc.num_tokens)
                return doc
            if cursor.pass_docs == 0:
                cursor.dead = True
            else:
                cursor.finished = True
            if epoch_over(cfg, self._cursors, index, self._epoch_docs):
                return None
            if not cursor.dead:
                cursor.start_pass(cfg, self.epoch, cursor.passes + 1)
                self._seen[index] = KeySet()
        return None

    def _read_from(self, cursor: DatasetCursor) -> Document | None:
        """The next document of one dataset's pass, or None when the pass is over. Any fault of one
        sample (reading, parsing, tokenizing, pricing; any exception) skips and reports that sample
        only. A key already read in this pass of the dataset, in this or another of its shards, is
        a duplicate: the first sample is kept, the later ones reported."""
        seen = self._seen[cursor.index]
        while cursor.shard < len(cursor.order):
            url = cursor.order[cursor.shard]
            if cursor.samples is None:
                start = cursor.cursor if cursor.cursor["samples"] else None
                cursor.samples = iter(self.source.iter_shard(url, self._problem, start))
            for sample in cursor.samples:
                cursor.cursor = {"samples": cursor.cursor["samples"] + 1, "offset": sample.get(NEXT_OFFSET)}
                key = sample["__key__"]
                digest = _key_hash(key)
                if digest in seen:
                    self._problem(SampleError(key, "the key was already read this epoch (from an earlier shard or "
                                              "sample); the first sample with this key is kept", url, "duplicate_key"))
                    continue
                seen.add(digest)
                doc = self._parse(sample, url)
                if doc is None:
                    continue
                self._tolerance.succeeded()
                return doc
            cursor.next_shard()
        return None

    def dataset_counts(self) -> list[dict]:
        """Per dataset: documents and tokens drawn over all epochs, documents this epoch, restarts."""
        return [{"name": d.name, "num_samples": int(self.totals[i, 0]), "num_tokens": int(self.totals[i, 1]),
                 "epoch_samples": c.epoch_docs, "restarts": c.passes}
                for i, (d, c) in enumerate(zip(self.config.mixture(), self._cursors))]

    def _parse(self, sample: dict, url: str) -> Document | None:
        key = sample["__key__"]
        try:
            return self.source.parse(sample)
        except SampleError as exc:
            self._problem(exc)
        except (ImportError, DataQualityError):
            raise  # the environment or the job is broken, not this sample
        except Exception as exc:  # RecursionError, MemoryError, a codec bug: this sample's
            self._problem(SampleError(key, f"could not be parsed ({type(exc).__name__}: {str(exc)[:200]})", url,
                                      "parse_failed"))
        return None

    def _plan_batch(self, batch: list[PackedSequence], step: int, epoch: int) -> StepPlan:
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, step, 0xB47C])  # per step: step k never depends on others
        D, S = cfg.dp_size, cfg.seqs_per_microbatch
        M = min(cfg.num_microbatches, math.ceil(len(batch) / (D * S)))
        batch = batch + [PackedSequence(seq_len=cfg.seq_len) for _ in range(D * M * S - len(batch))]
        instance = batch_instance(batch, cfg, M)
        assignment = PLANNERS[cfg.reorder_algorithm](instance, rng)
        baseline = PLANNERS["arrival"](instance, rng)
        planned = evaluate(instance, assignment)
        simulation = {"iteration_s": planned["iteration_s"], "lower_bound_s": planned["lower_bound_s"],
                      "arrival_iteration_s": evaluate(instance, baseline)["iteration_s"],
                      "bubble_fraction": _bubble(instance, assignment, planned["iteration_s"])}
        return StepPlan(step=step, epoch=epoch, sequences=batch, assignment=assignment,
                        baseline_assignment=baseline, simulation=simulation)


class KeySet:
    """Hashes of the keys read this epoch, 8 bytes per key: a sorted uint64 array, plus the recent
    ones in a set merged in when it reaches an eighth of the array (O(n log n) over an epoch)."""

    def __init__(self, hashes: np.ndarray | None = None):
        self._sorted = np.sort(np.asarray(hashes, dtype=np.uint64)) if hashes is not None \
            else np.empty(0, dtype=np.uint64)
        self._recent: set[int] = set()

    def __contains__(self, digest: int) -> bool:
        if digest in self._recent:
            return True
        index = int(np.searchsorted(self._sorted, np.uint64(digest)))
        return index < len(self._sorted) and int(self._sorted[index]) == digest

    def __len__(self) -> int:
        return len(self._sorted) + len(self._recent)

    def add(self, digest: int) -> None:
        self._recent.add(digest)
        if len(self._recent) >= max(4096, len(self._sorted) // 8):
            self._merge()

    def _merge(self) -> None:
        if self._recent:
            recent = np.fromiter(self._recent, dtype=np.uint64, count=len(self._recent))
            self._sorted = np.sort(np.concatenate([self._sorted, recent]))
            self._recent = set()

    def to_array(self) -> np.ndarray:
        self._merge()
        return self._sorted


def _pack_hashes(keys: KeySet) -> str:
    return base64.b64encode(zlib.compress(keys.to_array().tobytes(), 1)).decode("ascii")


def _unpack_hashes(text: str, limit: int = MAX_SEEN_BYTES) -> np.ndarray:
    packed = zlib.decompressobj()
    raw = packed.decompress(base64.b64decode(text), limit)
    if packed.unconsumed_tail or len(raw) % 8:
        raise ValueError(f"planner state: the key hashes are not a whole number of 8-byte hashes within "
                         f"{MAX_SEEN_BYTES} bytes")
    return np.frombuffer(raw, dtype=np.uint64)


def _key_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


class ErrorTolerance:
    """Fails a job that reads mostly garbage: more than ``max_consecutive`` bad samples in a row,
    or a bad share above ``max_fraction`` once ``min_samples`` were read (per epoch)."""

    def __init__(self, max_consecutive: int, max_fraction: float, min_samples: int = 100):
        self.max_consecutive, self.max_fraction, self.min_samples = max_consecutive, max_fraction, min_samples
        self.consecutive = self.bad = self.total = 0

    def succeeded(self) -> None:
        self.consecutive = 0
        self.total += 1

    def failed(self, exc: SampleError) -> None:
        self.consecutive += 1
        self.bad += 1
        self.total += 1
        if self.consecutive > self.max_consecutive:
            raise DataQualityError(f"{self.consecutive} bad samples in a row (max_consecutive_errors "
                                   f"{self.max_consecutive}); the last: {exc}; is the data set what you meant?")
        if self.total >= self.min_samples and self.bad > self.max_fraction * self.total:
            raise DataQualityError(f"{self.bad} of the {self.total} samples read this epoch are bad, more than "
                                   f"max_error_fraction {self.max_fraction:g}; the last: {exc}")


def _bubble(instance: Instance, assignment: np.ndarray, iteration_s: float) -> float:
    """Predicted idle share of the D x P stage slots over the simulated iteration."""
    fwd, bwd = instance.model.stage_times(instance.costs)
    busy = float((fwd + bwd)[:, assignment].sum())
    capacity = instance.D * fwd.shape[0] * iteration_s
    return max(0.0, 1.0 - busy / capacity) if capacity > 0 else 0.0


def batch_instance(batch: list[PackedSequence], config: JobConfig, num_microbatches: int) -> Instance:
    """The reordering problem of one global batch: module forward times of each sequence."""
    costs = np.array([(s.cost.encoder_s, s.cost.backbone_s, s.cost.generator_s) for s in batch], dtype=float)
    return Instance(D=config.dp_size, M=num_microbatches, S=config.seqs_per_microbatch,
                    model=config.stage_model(), costs=costs.reshape(len(batch), 3))
