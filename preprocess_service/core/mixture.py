"""Weighted blending of a job's datasets: which dataset the next document comes from, and where
each dataset's reading stands. Pure: no I/O (the planner reads through its SampleSource).

Blending is deterministic and needs no random draws: the next document comes from the dataset
furthest below its share, ``weight_i * (total + 1) - count_i`` largest (ties to the first listed),
as Megatron-LM's blended datasets do. Counts are documents (``mix_by="samples"``) or their tokens
(``"tokens"``). Over any prefix of the epoch each dataset's share is within one document (or one
document's tokens) of its weight, which seeded random draws only reach on average. The seed still
decides each dataset's shard order and the shuffle buffer that follows.

An epoch ends by ``JobConfig.mix_epoch``: "first_exhausted" when any dataset runs out (no sample
is repeated, the shares hold to the end); "all_exhausted" when every dataset was read through at
least once, those that run out earlier starting again (a new pass, in a new seeded shard order);
or, with ``mix_epoch_samples`` > 0, after that many documents, datasets restarting as needed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from disttrain_api.config import JobConfig


def shard_order(urls: list[str], *, seed: int, epoch: int, shuffle: bool, salt: tuple[int, ...] = ()) -> list[str]:
    """An epoch's shard order: a seeded permutation (or the given order). ``salt`` tells the
    datasets of a mixture and their passes apart; () is a plain job's first pass."""
    if not shuffle:
        return list(urls)
    rng = np.random.default_rng([seed, epoch, 0x5A4D, *salt])
    return [urls[i] for i in rng.permutation(len(urls))]


@dataclass(slots=True)
class DatasetCursor:
    """Where one dataset's reading stands in the current epoch."""

    urls: list[str]
    index: int
    """The dataset's position in JobConfig.mixture()."""
    order: list[str] = field(default_factory=list)
    passes: int = 0
    """Passes started this epoch, minus one (0 in the first)."""
    shard: int = 0
    """Position in ``order`` of the shard being read."""
    cursor: dict = field(default_factory=lambda: {"samples": 0, "offset": None})
    """Samples of that shard consumed so far, and where the next starts (shards.iter_shard)."""
    samples: Iterator[dict] | None = None
    """The open shard's samples (not state: reopened from ``cursor`` after a restore)."""
    finished: bool = False
    """Read through once this epoch (it may have started another pass since)."""
    pass_docs: int = 0
    """Documents drawn in the current pass."""
    epoch_docs: int = 0
    """Documents drawn this epoch (all passes)."""
    dead: bool = False
    """Ran out in a pass that gave no document: left out of the blend for the rest of the epoch
    (restarting it would read nothing again)."""

    def start_pass(self, config: JobConfig, epoch: int, passes: int) -> None:
        salt = () if (self.index, passes) == (0, 0) else (self.index, passes)
        self.order = shard_order(self.urls, seed=config.seed, epoch=epoch, shuffle=config.shard_shuffle, salt=salt)
        self.passes, self.shard, self.samples, self.pass_docs = passes, 0, None, 0
        self.cursor = {"samples": 0, "offset": None}

    def next_shard(self) -> None:
        self.samples = None
        self.shard += 1
        self.cursor = {"samples": 0, "offset": None}

    def state_dict(self) -> dict:
        return {"passes": self.passes, "shard": self.shard, **self.cursor, "finished": self.finished,
                "pass_docs": self.pass_docs, "epoch_docs": self.epoch_docs, "dead": self.dead}

    def load_state_dict(self, state: dict, config: JobConfig, epoch: int) -> None:
        self.start_pass(config, epoch, int(state.get("passes", 0)))
        self.shard = int(state["shard"])
        self.cursor = {"samples": int(state["samples"]), "offset": state["offset"]}
        self.finished = bool(state.get("finished", False))
        self.pass_docs = int(state.get("pass_docs", 0))
        self.epoch_docs = int(state.get("epoch_docs", 0))
        self.dead = bool(state.get("dead", False))


@dataclass(slots=True)
class Blend:
    """Per-dataset counts and the choice of the next dataset."""

    weights: np.ndarray
    """Normalised weights, one per dataset."""
    by_tokens: bool = False
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Documents (or tokens, by_tokens) drawn this epoch, per dataset."""

    @classmethod
    def of(cls, config: JobConfig) -> Blend:
        weights = np.array([d.weight for d in config.mixture()], dtype=float)
        return cls(weights=weights / weights.sum(), by_tokens=config.mix_by == "tokens",
                   counts=np.zeros(len(weights), dtype=np.int64))

    def choose(self, live: np.ndarray) -> int:
        """The dataset furthest below its share among the ``live`` ones (the first of equals)."""
        if len(self.weights) == 1:
            return 0
        weights = np.where(live, self.weights, 0.0)  # shares among the live datasets
        weights = weights / weights.sum()
        deficit = weights * float(self.counts[live].sum() + 1) - self.counts
        return int(np.argmax(np.where(live, deficit, -np.inf)))

    def record(self, dataset: int, num_tokens: int) -> None:
        self.counts[dataset] += num_tokens if self.by_tokens else 1


def epoch_over(config: JobConfig, cursors: list[DatasetCursor], exhausted: int | None, num_docs: int) -> bool:
    """Whether the epoch ends now: ``exhausted`` is the dataset that just ran out (or None),
    ``num_docs`` the documents drawn this epoch so far."""
    if all(c.dead for c in cursors):
        return True
    if config.mix_epoch_samples:
        return num_docs >= config.mix_epoch_samples
    if exhausted is None or cursors[exhausted].dead:
        return False
    if config.mix_epoch == "first_exhausted" or len(cursors) == 1:
        return True
    return all(c.finished or c.dead for c in cursors)  # all_exhausted
