"""Deterministic, resumable planning of a job: shards -> documents -> packed sequences -> step plans.

Hook order for every epoch: shard order (seeded) -> read (a DocumentSource) -> parse (priced from
metadata, bad samples skipped) -> shuffle buffer (seeded) -> pack -> price -> group B sequences
into a global batch -> the job's batch planner (reorder.PLANNERS: which rank, which
microbatch, which order) -> StepPlan. The plan of step k is a function of the JobConfig and the
data alone, so it can be rebuilt anywhere.

The planner is a state machine, not a generator, and its state does not grow with the data or the
position. Documents are planned in blocks of ``shuffle_buffer`` documents (UNSHUFFLED_BLOCK for 1): a
block is read (each dataset from ``open_shards`` open shards at once, in turn: core/mixture.py),
permuted by a generator seeded with the block's index, packed, and the packer is flushed at its
end. A block's sequences are therefore a function of where reading stood when it
began (its anchor: per dataset the shard order's position and a few numbers per open shard, the
blend's counts, error counters). ``state_dict()`` between two steps is that anchor plus how many of
the block's sequences were already batched: a few KB. ``load_state_dict()`` rebuilds the block
from the anchor (reading one block of samples again) and drops the batched sequences: the next
plan equals the one the original planner would have made, on any node, at any DP size (the
sequences do not depend on the layout; the next batch takes the next ``global_batch`` of them).

Duplicate keys (``JobConfig.dedup``): "pass" (default) keeps the first sample of a key read in a
dataset's pass, in this shard or an earlier one; the key hashes (8 bytes per sample read this
pass) live in memory, not in the state, and a restore reads them again from the shards read so
far (their keys only, where the source can: an img2dataset manifest). "shard" keeps the first of a
key within its shard only, so memory and restore do not grow with the position; a key copied into
another shard is then a second sample. Pure: samples are read and parsed through one injected
DocumentSource (the service's is service/documents.py).

The last global batch of an epoch may be short: it gets ceil(n / (D*S)) microbatches per rank,
padded with empty sequences, so every sample is delivered (no drop_last).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from disttrain_api.config import JobConfig
from disttrain_api.errors import ConfigError, DataQualityError, PermissionDenied, SampleError
from preprocess_service.core import reorder
from preprocess_service.core.feedback import REFIT_FIELDS as COST_FIELDS
from preprocess_service.core.mixture import Blend, DatasetCursor, Slot, epoch_over, seek_cursor
from preprocess_service.core.packing import PackedSequence, Packer, price
from preprocess_service.core.reorder.instance import PLANNERS, Instance, evaluate
from preprocess_service.core.sample import EPOCH, NEXT_OFFSET, Document
from preprocess_service.core.shardnames import ShardNames, as_names

SkipSink = Callable[[SampleError], None]
Parse = Callable[[dict], Document]
"""Turns a raw sample (``__key__``, ``__url__``, member -> bytes) into a Document or raises SampleError."""

STATE_VERSION = 3
"""3: a block's anchor and the sequences of it already batched (2: key hashes and the buffer's
documents; not read any more)."""
RAMP_BLOCK = 256
"""The first block of an epoch holds at most this many documents, each next one twice as many up
to ``shuffle_buffer``: an epoch's first step waits for 256 documents to be read, not 4096."""
UNSHUFFLED_BLOCK = 1024
"""Documents per block with ``shuffle_buffer`` 1 (read in order, not permuted): the packer is
flushed at a block's end, so blocks of one document would pad each to a sequence."""


class SampleSource(Protocol):
    """Where samples come from (adapters/io/shards.ShardReader)."""

    def iter_shard(self, url: str, on_problem: SkipSink, start: dict | None = None) -> Iterator[dict]:
        """Raw samples of one shard, from ``start`` (a cursor: {"samples": n, "offset": bytes or None})."""

    def read_samples(self, url: str, keys: set[str]) -> dict[str, dict]:
        """The raw samples of ``keys`` in one shard; keys that cannot be read are missing."""

    def shard_keys(self, url: str, limit: int | None = None) -> Iterator[str]:
        """The keys of the first ``limit`` (None: all) samples ``iter_shard`` yields, in order, as
        cheaply as the source can (a manifest, else reading the shard); problems are not reported."""


class DocumentSource(SampleSource, Protocol):
    """Everything the planner reads through: a shard's samples from a cursor, samples by key, a
    sample parsed into a Document, and where skipped samples go. What the source does around
    that (reading a shard's side files when a pass starts it, deciding which documents keep their
    encoded bytes until they are decoded) is its own business, not the planner's."""

    fingerprint: str
    """What else the plans depend on (the tokenizer file's digest): saved in the state, and a
    state with another one is refused, since it was planned with other token counts."""

    def iter_shard(self, url: str, on_problem: SkipSink, start: dict | None = None,
                   dataset: int | None = None) -> Iterator[dict]:
        """SampleSource.iter_shard of a shard of dataset ``dataset`` (its index in the mixture):
        the source parses that shard's samples with that dataset's settings."""

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

    def iter_shard(self, url: str, on_problem: SkipSink, start: dict | None = None,
                   dataset: int | None = None) -> Iterator[dict]:
        return self.samples.iter_shard(url, on_problem, start)

    def read_samples(self, url: str, keys: set[str]) -> dict[str, dict]:
        return self.samples.read_samples(url, keys)

    def shard_keys(self, url: str, limit: int | None = None) -> Iterator[str]:
        return keys_by_reading(self.samples, url, limit)

    def skipped(self, problem: SampleError) -> None:
        self.on_skip(problem)


def keys_by_reading(samples: SampleSource, url: str, limit: int | None = None) -> Iterator[str]:
    """SampleSource.shard_keys by reading the shard's samples (for sources without a manifest)."""
    for sample in itertools.islice(samples.iter_shard(url, lambda problem: None), limit):
        yield sample["__key__"]


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

    def __init__(self, config: JobConfig, shard_urls: Sequence[Sequence[str]] | Sequence[str],
                 source: DocumentSource):
        """``shard_urls``: each dataset's shard names, in ``config.mixture()`` order (a flat list is
        the one dataset of a plain job)."""
        self.config = config
        if config.reorder_algorithm not in PLANNERS:
            raise ConfigError(f"unknown reorder_algorithm {config.reorder_algorithm!r}; this server has "
                              f"{sorted(PLANNERS)}")
        self.dataset_urls: list[ShardNames] = \
            [as_names(urls) for urls in shard_urls] if len(shard_urls) and not isinstance(shard_urls[0], str) \
            else [as_names(shard_urls)]  # type: ignore[arg-type]
        if len(self.dataset_urls) != len(config.mixture()):
            raise ValueError(f"{len(self.dataset_urls)} shard lists for {len(config.mixture())} datasets")
        self.totals = [[0, 0] for _ in self.dataset_urls]
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
        self._block = 0
        """Index in the epoch of the next block to read."""
        self._packer = Packer(cfg.seq_len, cfg.pack_window)
        self._ready: list[PackedSequence] = []
        self._blocks: deque[tuple[dict, int]] = deque()
        """(anchor, sequences) of each block that still has sequences in ``_ready``, oldest first."""
        self._taken = 0
        """Sequences of the oldest of those blocks already batched."""
        self._drained = False
        self._failure: DataQualityError | None = None
        """The error tolerance failed the job while a block was read: its documents read before
        are planned first, then this is raised (the steps before a failure are still sent)."""
        self._tolerance = ErrorTolerance(cfg.max_consecutive_errors, cfg.max_error_fraction)
        self._seen = [KeySet() for _ in self._cursors]
        """dedup "pass": hashes of the keys read in each dataset's current pass (keys repeat across datasets)."""

    def _anchor(self) -> dict:
        """Where reading stands at a block boundary: everything the next block is a function of."""
        return {"epoch": self.epoch, "block": self._block,
                "datasets": [cursor.state_dict() for cursor in self._cursors],
                "blend": self._blend.counts.tolist(), "epoch_docs": self._epoch_docs,
                "totals": [list(t) for t in self.totals],
                "tolerance": [self._tolerance.consecutive, self._tolerance.bad, self._tolerance.total]}

    def state_dict(self) -> dict:
        """Where planning stands between two steps: small (its size does not depend on the data or
        the position), JSON-serialisable, versioned."""
        anchor, taken = (self._blocks[0][0], self._taken) if self._blocks else (self._anchor(), 0)
        return {"version": STATE_VERSION, "fingerprint": self.fingerprint, "step": self.step, "done": self.done,
                "anchor": anchor, "taken": taken, "failure": "" if self._failure is None else str(self._failure),
                "cost": {name: getattr(self.cost, name) for name in COST_FIELDS}}

    def load_state_dict(self, state: dict) -> None:
        """Continues from ``state``: the block it names is read again from its anchor, and the
        duplicate-key hashes of the pass are rebuilt from the shards read so far."""
        version = state.get("version") if isinstance(state, dict) else state
        if version != STATE_VERSION:
            raise ValueError(f"planner state version {version!r} is not {STATE_VERSION}")
        anchor = state["anchor"]
        if len(anchor["datasets"]) != len(self._cursors) or len(anchor["blend"]) != len(self._cursors):
            raise ValueError(f"planner state of {len(anchor['datasets'])} datasets, this job has {len(self._cursors)}")
        saved = state.get("fingerprint", "")
        if saved != self.fingerprint:
            raise ValueError(f"planner state planned with tokenizer file {saved[:12] or 'byte'!r}, this job's is "
                             f"{self.fingerprint[:12] or 'byte'!r}: the file changed, so would the plans")
        self._start_epoch(int(anchor["epoch"]), int(state["step"]))
        self.done = bool(state["done"])
        self._block = int(anchor["block"])
        for cursor, saved_cursor in zip(self._cursors, anchor["datasets"]):
            cursor.load_state_dict(saved_cursor, self.config, self.epoch)
        self._blend.counts = np.array(anchor["blend"], dtype=np.int64)
        self._epoch_docs = int(anchor["epoch_docs"])
        self.totals = [[int(docs), int(tokens)] for docs, tokens in anchor["totals"]]
        if len(self.totals) != len(self._cursors):
            raise ValueError(f"planner state: totals of {len(self.totals)} datasets, this job has {len(self._cursors)}")
        t = anchor["tolerance"]
        self._tolerance.consecutive, self._tolerance.bad, self._tolerance.total = (int(x) for x in t)
        self.cost = dataclasses.replace(self.config.cost, **state["cost"])
        for cursor in self._cursors:
            self._replay_keys(cursor)
        if state.get("failure"):  # the job failed its error tolerance there: it stays failed after a restore
            self._failure = DataQualityError(str(state["failure"]))
        taken = int(state["taken"])
        if taken and not self.done:
            self._read_block()
            if not self._blocks or taken > self._blocks[0][1]:
                raise ValueError(f"planner state: {taken} sequences of a block that packs fewer (the data changed)")
            del self._ready[:taken]
            self._taken = taken

    def _replay_keys(self, cursor: DatasetCursor) -> None:
        """The key hashes of what the pass read before the anchor (for duplicate detection)."""
        by_pass = self.config.dedup == "pass"
        seen = self._seen[cursor.index]
        if by_pass:
            for position in cursor.read_through():
                url = cursor.order.safe_name(position) if isinstance(cursor.order, ShardNames) \
                    else cursor.order[position]
                for key in self.source.shard_keys(url) if url else ():
                    seen.add(_key_hash(key))
        for slot in cursor.slots:
            if slot.samples:
                hashes = (_key_hash(k) for k in self.source.shard_keys(cursor.order[slot.position], slot.samples))
                if by_pass:
                    for digest in hashes:
                        seen.add(digest)
                else:
                    slot.keys = set(hashes)

    def seek(self, samples: int, shard_sizes: np.ndarray, step: int) -> int:
        """Moves a one-dataset planner at the start of its epoch to the block holding the epoch's
        sample ``samples``, without reading what comes before: the shard order and the waves are a
        function of the position given every shard's sample count (``shard_sizes`` in the listed
        order, e.g. from manifests). Returns the block's first sample. Exact when every sample
        gives a document. Two things are not functions of the position: the step number (how many
        sequences the earlier blocks packed; the caller gives it) and, with dedup "pass", the key
        hashes of everything read before (rebuilt here by reading every earlier shard's keys)."""
        if len(self._cursors) != 1 or self._epoch_docs or self._ready:
            raise ValueError("seek() needs a one-dataset planner at the start of an epoch")
        block = 0
        while self.block_start(block + 1) <= samples:
            block += 1 if block < 64 else (samples - self.block_start(block)) // self.block_size(block)
        start = self.block_start(block)
        cursor = self._cursors[0]
        seek_cursor(cursor, shard_sizes, self.config.shards_open, start)
        self._block, self._epoch_docs, self.step = block, start, step
        self._blend.counts[0] = start
        self.totals[0][0] += start
        self._replay_keys(cursor)
        return start

    # --- planning ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[StepPlan]:
        while (plan := self.next_plan()) is not None:
            yield plan

    def next_plan(self) -> StepPlan | None:
        """The plan of step ``self.step``, or None once every epoch is planned."""
        cfg = self.config
        while not self.done:
            while len(self._ready) < cfg.global_batch and not self._drained and self._failure is None:
                self._read_block()
            if not self._ready and self._failure is not None:
                raise self._failure
            if self._ready:
                batch = self._take(cfg.global_batch)
                for seq in batch:  # priced now: a refit between two steps prices every later step
                    seq.cost = price(seq, self.cost)
                plan = self._plan_batch(batch, self.step, self.epoch)
                self.step += 1
                if self._drained and not self._ready:
                    self._next_epoch()
                return plan
            self._next_epoch()
        return None

    def _take(self, count: int) -> list[PackedSequence]:
        batch, self._ready = self._ready[:count], self._ready[count:]
        self._taken += len(batch)
        while self._blocks and self._taken >= self._blocks[0][1]:
            self._taken -= self._blocks.popleft()[1]
        return batch

    def _next_epoch(self) -> None:
        if self.epoch + 1 >= self.config.num_epochs:
            self.done = True
        else:
            self._start_epoch(self.epoch + 1, self.step)

    def block_size(self, block: int) -> int:
        """Documents of the epoch's block ``block``: RAMP_BLOCK doubling up to shuffle_buffer."""
        full = self.config.shuffle_buffer if self.config.shuffle_buffer > 1 else UNSHUFFLED_BLOCK
        return min(full, RAMP_BLOCK << block) if block < 32 else full

    def block_start(self, block: int) -> int:
        """The epoch position of block ``block``'s first document (every block full before it)."""
        ramp = min(block, 32)
        start = sum(self.block_size(b) for b in range(ramp))
        return start + (block - ramp) * self.block_size(block)

    def _read_block(self) -> None:
        """Reads, permutes and packs the next block; sets ``_drained`` once the epoch has no more
        documents. The permutation comes from a generator seeded with the block's index."""
        cfg = self.config
        anchor = self._anchor()
        rng = np.random.default_rng([cfg.seed, self.epoch, self._block, 0xB10C])
        size = self.block_size(self._block)
        self._block += 1
        docs: list[Document] = []
        try:
            while len(docs) < size:
                doc = self._next_document()
                if doc is None:
                    self._drained = True
                    break
                docs.append(doc)
        except DataQualityError as exc:
            if not docs:
                raise
            self._failure = exc
        if not docs:
            return
        order = rng.permutation(len(docs)) if cfg.shuffle_buffer > 1 else range(len(docs))
        sequences: list[PackedSequence] = []
        for i in order:
            sequences.extend(self._packer.add(docs[i]))
        sequences.extend(self._packer.flush())
        self._ready.extend(sequences)
        self._blocks.append((anchor, len(sequences)))

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
            index = 0 if len(self._cursors) == 1 else self._blend.choose(np.array([not c.dead for c in self._cursors]))
            cursor = self._cursors[index]
            doc = self._read_from(cursor)
            if doc is not None:
                cursor.pass_docs += 1
                cursor.epoch_docs += 1
                self._blend.record(index, doc.num_tokens)
                self._epoch_docs += 1
                total = self.totals[index]
                total[0] += 1
                total[1] += doc.num_tokens
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
        """The next document of one dataset's pass, from its open shards in turn (mixture.py), or
        None when the pass is over. Any fault of one sample (reading, parsing, tokenizing,
        pricing; any exception) skips and reports that sample only. A key read before (dedup
        "pass": in this pass of the dataset, in any of its shards; "shard": in this shard) is a
        duplicate: the first sample is kept, the later ones reported."""
        by_pass = self.config.dedup == "pass"
        seen = self._seen[cursor.index]
        while (slot := cursor.slot(self.config.shards_open)) is not None:
            try:
                url = cursor.order[slot.position]
            except (ConfigError, PermissionDenied) as exc:  # a lazily made name the policy refuses
                self._problem(SampleError("", f"shard {slot.position} of this pass's order cannot be opened: {exc}",
                                          "", "shard_error"))
                cursor.advance(ended=True)
                continue
            if slot.iterator is None:
                start = {"samples": slot.samples, "offset": slot.offset} if slot.samples else None
                slot.iterator = iter(self.source.iter_shard(url, self._problem, start, dataset=cursor.index))
            doc = self._read_slot(slot, url, seen if by_pass else slot.keys, by_pass)
            cursor.advance(ended=doc is None)
            if doc is not None:
                return doc
        return None

    def _read_slot(self, slot: Slot, url: str, seen, by_pass: bool) -> Document | None:
        assert slot.iterator is not None
        for sample in slot.iterator:
            slot.samples += 1
            slot.offset = sample.get(NEXT_OFFSET)
            key = sample["__key__"]
            digest = _key_hash(key)
            if digest in seen:
                where = "from an earlier shard or sample" if by_pass else "earlier in this shard"
                self._problem(SampleError(key, f"the key was already read this epoch ({where}); the first sample "
                                          "with this key is kept", url, "duplicate_key"))
                continue
            seen.add(digest)
            doc = self._parse(sample, url)
            if doc is None:
                continue
            self._tolerance.succeeded()
            return doc
        return None

    def dataset_counts(self) -> list[dict]:
        """Per dataset: documents and tokens drawn over all epochs, documents this epoch, restarts."""
        return [{"name": d.name, "num_samples": self.totals[i][0], "num_tokens": self.totals[i][1],
                 "epoch_samples": c.epoch_docs, "restarts": c.passes}
                for i, (d, c) in enumerate(zip(self.config.mixture(), self._cursors))]

    def _parse(self, sample: dict, url: str) -> Document | None:
        key = sample["__key__"]
        sample[EPOCH] = self.epoch  # what plugins are seeded by (the sample is ours: a reader's dict)
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
    """Hashes of the keys read this pass, 8 bytes per key (in memory, never in the state): a sorted
    uint64 array, plus the recent ones in a set merged in when it reaches an eighth of the array
    (O(n log n) over an epoch)."""

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
