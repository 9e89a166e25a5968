"""Deterministic, resumable planning of a job: shards -> documents -> packed sequences -> step plans.

Hook order for every epoch: shard order (seeded) -> read (a SampleSource) -> parse (priced from
metadata, bad samples skipped) -> shuffle buffer (seeded) -> pack -> price -> group B sequences
into a global batch -> the job's batch planner (reorder.instance.PLANNERS: which rank, which
microbatch, which order) -> StepPlan. The plan of step k is a function of the JobConfig and the
data alone, so it can be rebuilt anywhere.

The planner is a state machine, not a generator: ``state_dict()`` between two steps holds where
it stands (epoch, step, shard cursor, the shuffle buffer's and the packer's documents as
references, the shuffle generator, error counters, the keys read this epoch as 8-byte hashes and
the cost coefficients), and ``load_state_dict()`` continues from there on any node: the next plan
equals the one the original planner would have made, with no replanning from step 0. Its cost
does not grow with the position in the epoch, except the key hashes (8 bytes per sample read this
epoch, for duplicate detection). Pure: the samples come from an injected SampleSource and are
parsed by an injected function (adapters/shards.py and adapters/samples.py in the service).

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
from disttrain_api.errors import DataQualityError, SampleError
from preprocess_service.core import reorder
from preprocess_service.core.feedback import REFIT_FIELDS as COST_FIELDS
from preprocess_service.core.packing import PackedSequence, Packer, price
from preprocess_service.core.reorder.instance import PLANNERS, Instance, evaluate
from preprocess_service.core.sample import NEXT_OFFSET, Document

SkipSink = Callable[[SampleError], None]
Parse = Callable[[dict], Document]
"""Turns a raw sample (``__key__``, ``__url__``, member -> bytes) into a Document or raises SampleError."""

STATE_VERSION = 1
MAX_SEEN_BYTES = 8 << 27
"""Key hashes a loaded state may hold: 134 million keys (a stored state is data too)."""


class SampleSource(Protocol):
    """Where samples come from (adapters/shards.ShardReader)."""

    def iter_shard(self, url: str, on_problem: SkipSink, start: dict | None = None) -> Iterator[dict]:
        """Raw samples of one shard, from ``start`` (a cursor: {"samples": n, "offset": bytes or None})."""

    def read_samples(self, url: str, keys: set[str]) -> dict[str, dict]:
        """The raw samples of ``keys`` in one shard; keys that cannot be read are missing."""


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
    """Plans a job's steps in order (``next_plan()``); skipped samples go to ``on_skip``."""

    def __init__(self, config: JobConfig, shard_urls: list[str], source: SampleSource, parse: Parse,
                 on_skip: SkipSink, keep_media: Callable[[Document], bool] = lambda doc: True):
        self.config = config
        self.shard_urls = list(shard_urls)
        self.source = source
        self.parse = parse
        self.on_skip = on_skip
        self.keep_media = keep_media
        """Asked for every parsed document whether it keeps its encoded bytes until it is decoded
        (else they are dropped now and re-read then)."""
        self.cost = config.cost
        """Coefficients the next sequences are priced with (feedback.py may replace them mid-job)."""
        self.done = False
        self._start_epoch(0, 0)

    # --- state ---------------------------------------------------------------------------------
    def _start_epoch(self, epoch: int, step: int) -> None:
        cfg = self.config
        self.epoch, self.step = epoch, step
        self._order = shard_order(self.shard_urls, seed=cfg.seed, epoch=epoch, shuffle=cfg.shard_shuffle)
        self._shard = 0
        self._cursor: dict = {"samples": 0, "offset": None}
        self._samples: Iterator[dict] | None = None
        self._rng = np.random.default_rng([cfg.seed, epoch, 0xD15])
        self._buffer: list[Document] = []
        self._packer = Packer(cfg.seq_len, cfg.pack_window)
        self._ready: list[PackedSequence] = []
        self._drained = False
        self._tolerance = ErrorTolerance(cfg.max_consecutive_errors, cfg.max_error_fraction)
        self._seen = KeySet()

    def state_dict(self) -> dict:
        """Where planning stands between two steps: small, JSON-serialisable, versioned."""
        def refs(docs):
            return [[doc.shard, doc.key] for doc in docs]

        seen = self._seen.to_array().tobytes()
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch, "step": self.step, "done": self.done,
            "cursor": {"shard": self._shard, **self._cursor},
            "rng": self._rng.bit_generator.state,
            "buffer": refs(self._buffer),
            "packer": [refs(seq.documents) for seq in self._packer.open],
            "ready": [refs(seq.documents) for seq in self._ready],
            "drained": self._drained,
            "tolerance": [self._tolerance.consecutive, self._tolerance.bad, self._tolerance.total],
            "seen": base64.b64encode(zlib.compress(seen, 1)).decode("ascii"),
            "cost": {name: getattr(self.cost, name) for name in COST_FIELDS},
        }

    def load_state_dict(self, state: dict) -> None:
        """Continues from ``state``: the documents it names are re-read (by key) and re-parsed,
        so resuming costs about one shuffle buffer of reads wherever in the epoch it happens."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"planner state version {state.get('version') if isinstance(state, dict) else state!r} "
                             f"is not {STATE_VERSION}")
        self._start_epoch(int(state["epoch"]), int(state["step"]))
        self.done = bool(state["done"])
        cursor = state["cursor"]
        self._shard = int(cursor["shard"])
        self._cursor = {"samples": int(cursor["samples"]), "offset": cursor["offset"]}
        self._rng.bit_generator.state = state["rng"]
        self._drained = bool(state["drained"])
        t = state["tolerance"]
        self._tolerance.consecutive, self._tolerance.bad, self._tolerance.total = (int(x) for x in t)
        packed = zlib.decompressobj()
        raw = packed.decompress(base64.b64decode(state["seen"]), MAX_SEEN_BYTES)
        if packed.unconsumed_tail or len(raw) % 8:
            raise ValueError(f"planner state: the key hashes are not a whole number of 8-byte hashes within "
                             f"{MAX_SEEN_BYTES} bytes")
        seen = np.frombuffer(raw, dtype=np.uint64)
        self._seen = KeySet(seen)
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
                    self.on_skip(SampleError(key, "could not be re-read when planning resumed (the shard changed "
                                             "or cannot be read)", shard, "resume_reread"))
                    continue
                doc = self._parse(sample, shard)
                if doc is not None:
                    if not self.keep_media(doc):
                        doc.media_bytes = None
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
        self.on_skip(exc)
        if exc.kind not in SampleError.NOT_LOST:
            self._tolerance.failed(exc)

    def _next_document(self) -> Document | None:
        """The epoch's next document. Any fault of one sample (reading, parsing, tokenizing, pricing;
        any exception) skips and reports that sample only. A key already read this epoch, in this
        or another shard, is a duplicate: the first sample is kept, the later ones reported."""
        while self._shard < len(self._order):
            url = self._order[self._shard]
            if self._samples is None:
                start = self._cursor if self._cursor["samples"] else None
                self._samples = iter(self.source.iter_shard(url, self._problem, start))
            for sample in self._samples:
                self._cursor = {"samples": self._cursor["samples"] + 1, "offset": sample.get(NEXT_OFFSET)}
                key = sample["__key__"]
                digest = _key_hash(key)
                if digest in self._seen:
                    self._problem(SampleError(key, "the key was already read this epoch (from an earlier shard or "
                                              "sample); the first sample with this key is kept", url, "duplicate_key"))
                    continue
                self._seen.add(digest)
                doc = self._parse(sample, url)
                if doc is None:
                    continue
                self._tolerance.succeeded()
                if not self.keep_media(doc):
                    doc.media_bytes = None
                return doc
            self._samples = None
            self._shard += 1
            self._cursor = {"samples": 0, "offset": None}
        return None

    def _parse(self, sample: dict, url: str) -> Document | None:
        key = sample["__key__"]
        try:
            return self.parse(sample)
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


def _key_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def shard_order(urls: list[str], *, seed: int, epoch: int, shuffle: bool) -> list[str]:
    """The epoch's shard order: a seeded permutation (or the given order)."""
    if not shuffle:
        return list(urls)
    rng = np.random.default_rng([seed, epoch, 0x5A4D])
    return [urls[i] for i in rng.permutation(len(urls))]


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
