"""Deterministic planning of a job: shards -> documents -> packed sequences -> per-step plans.

Hook order for every epoch: shard order (seeded) -> read -> parse_document (priced from
metadata, bad samples skipped) -> shuffle buffer (seeded) -> pack -> price -> group B sequences
into a global batch -> the job's batch planner (reorder.instance.PLANNERS: which rank, which
microbatch, which order) -> StepPlan. The plan of step k is
a function of the JobConfig and the data alone, so it can be rebuilt anywhere.

The last global batch of an epoch may be short: it gets ceil(n / (D*S)) microbatches per rank,
padded with empty sequences, so every sample is delivered (no drop_last).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from preprocess_service.core import reorder

from preprocess_service.adapters import shards
from preprocess_service.core.reorder.instance import PLANNERS, Instance, evaluate
from disttrain_api.config import JobConfig
from disttrain_api.errors import DataQualityError, SampleError
from preprocess_service.core.packing import PackedSequence, pack_documents, price
from preprocess_service.core.sample import Document, parse_document
from preprocess_service.core.tokenizer import Tokenizer

SkipSink = Callable[[SampleError], None]


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



class Planner:
    """Iterates a job's StepPlans in order; skipped samples go to ``on_skip``."""

    def __init__(self, config: JobConfig, shard_urls: list[str], tokenizer: Tokenizer, on_skip: SkipSink,
                 reader: shards.ShardReader = shards.DEFAULT_READER,
                 keep_media: Callable[[Document], bool] = lambda doc: True):
        self.config = config
        self.keep_media = keep_media
        """Asked for every parsed document whether it keeps its encoded bytes until it is decoded
        (else they are dropped now and re-read then)."""
        self.shard_urls = shard_urls
        self.reader = reader
        self.tokenizer = tokenizer
        self.on_skip = on_skip
        self.cost = config.cost
        """Coefficients the next sequences are priced with (feedback.py may replace them mid-job)."""

    def __iter__(self) -> Iterator[StepPlan]:
        return self.plans_from(0, 0)

    def plans_from(self, epoch: int, first_step: int) -> Iterator[StepPlan]:
        """The plans from the start of ``epoch``, whose first step is ``first_step``, to the end of
        the job. Each epoch starts afresh (its own shard order, shuffle buffer and packer), so this
        equals the tail of a full iteration: a planner can resume at any epoch start."""
        step = first_step
        for ep in range(epoch, self.config.num_epochs):
            for plan in self._plan_epoch(ep, step):
                yield plan
                step += 1

    def _plan_epoch(self, epoch: int, first_step: int) -> Iterator[StepPlan]:
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, epoch, 0xD15])
        documents = shards.shuffle_buffer(self._documents(epoch), size=cfg.shuffle_buffer, rng=rng)
        batch: list[PackedSequence] = []
        step = first_step
        for seq in pack_documents(documents, seq_len=cfg.seq_len, window=cfg.pack_window):
            seq.cost = price(seq, self.cost)
            batch.append(seq)
            if len(batch) == cfg.global_batch:
                yield self._plan_batch(batch, step, epoch)
                batch, step = [], step + 1
        if batch:
            yield self._plan_batch(batch, step, epoch)

    def _documents(self, epoch: int) -> Iterator[Document]:
        """The epoch's documents. Any fault of one sample (reading, parsing, tokenizing, pricing;
        any exception) skips and reports that sample only. A key already read this epoch, in this
        or another shard, is a duplicate: the first sample is kept, the later ones reported."""
        cfg = self.config
        order = shards.shard_order(self.shard_urls, seed=cfg.seed, epoch=epoch, shuffle=cfg.shard_shuffle)
        tolerance = ErrorTolerance(cfg.max_consecutive_errors, cfg.max_error_fraction)
        seen: set[str] = set()

        def problem(exc: SampleError) -> None:
            self.on_skip(exc)
            if exc.kind not in SampleError.NOT_LOST:
                tolerance.failed(exc)

        for url in order:
            for sample in self.reader.iter_shard(url, problem):
                key = sample["__key__"]
                if key in seen:
                    problem(SampleError(key, "the key was already read this epoch (from an earlier shard or "
                                        "sample); the first sample with this key is kept", url, "duplicate_key"))
                    continue
                seen.add(key)
                try:
                    doc = parse_document(sample, image_config=cfg.image, tokenizer=self.tokenizer,
                                         seq_len=cfg.seq_len, audio_config=cfg.audio, generation=cfg.generation)
                except SampleError as exc:
                    problem(exc)
                    continue
                except (ImportError, DataQualityError):
                    raise  # the environment or the job is broken, not this sample
                except Exception as exc:  # noqa: BLE001 (RecursionError, MemoryError, a codec bug: this sample's)
                    problem(SampleError(key, f"could not be parsed ({type(exc).__name__}: {str(exc)[:200]})", url,
                                        "parse_failed"))
                    continue
                tolerance.succeeded()
                if not self.keep_media(doc):
                    doc.media_bytes = None
                yield doc

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
