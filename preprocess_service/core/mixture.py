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

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from disttrain_api.config import JobConfig
from preprocess_service.core.shardnames import Permuted, positions


def shard_order(urls: Sequence[str], *, seed: int, epoch: int, shuffle: bool,
                salt: tuple[int, ...] = ()) -> Sequence[str]:
    """An epoch's shard order: a seeded permutation of the names (a view: shardnames.Permuted),
    or the names as given. ``salt`` tells the datasets of a mixture and their passes apart; () is
    a plain job's first pass."""
    if not shuffle:
        return urls
    rng = np.random.default_rng([seed, epoch, 0x5A4D, *salt])
    return Permuted(urls, rng.permutation(len(urls)))


@dataclass(slots=True)
class Slot:
    """One open shard of a dataset: where in the pass's shard order it is, and how far it was read."""

    position: int
    """Index of the shard in DatasetCursor.order."""
    samples: int = 0
    """Samples of it consumed so far."""
    offset: int | None = None
    """Where its next sample starts (shards.iter_shard's NEXT_OFFSET), if the source said."""
    iterator: Iterator[dict] | None = None
    """Its samples (not state: reopened from ``samples``/``offset`` after a restore)."""
    keys: set[int] = field(default_factory=set)
    """Hashes of the keys read from it (not state: re-read after a restore), for duplicates within a shard."""

    def state(self) -> list:
        return [self.position, self.samples, self.offset]


@dataclass(slots=True)
class DatasetCursor:
    """Where one dataset's reading stands in the current epoch. Shards are read in waves: the next
    ``open_shards`` shards of the order are opened together (``slots``) and read in rounds, one
    document from each slot that still has samples, in slot order; the next wave opens when every
    shard of this one ended. Given the shards' sizes, where reading stands after any number of
    samples is therefore a function of that number (``seek``), and the state is a few numbers per
    open shard, whatever the dataset's size."""

    urls: Sequence[str]
    index: int
    """The dataset's position in JobConfig.mixture()."""
    order: Sequence[str] = ()
    passes: int = 0
    """Passes started this epoch, minus one (0 in the first)."""
    next_shard: int = 0
    """Position in ``order`` of the next shard to open."""
    slots: list[Slot] = field(default_factory=list)
    turn: int = 0
    """Index in ``slots`` of the slot the next document comes from."""
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
        self.passes, self.next_shard, self.slots, self.turn, self.pass_docs = passes, 0, [], 0, 0

    def slot(self, open_shards: int) -> Slot | None:
        """The slot the next document comes from (opening the next wave when this one ended), or
        None when the pass has no shard left."""
        if not self.slots:
            while len(self.slots) < open_shards and self.next_shard < len(self.order):
                self.slots.append(Slot(self.next_shard))
                self.next_shard += 1
            self.turn = 0
        return self.slots[self.turn] if self.slots else None

    def advance(self, ended: bool) -> None:
        """The current slot gave a document (``ended`` False) or ended (it is closed)."""
        if ended:
            del self.slots[self.turn]
        else:
            self.turn += 1
        if self.turn >= len(self.slots):
            self.turn = 0

    @property
    def exhausted(self) -> bool:
        """Every shard of the pass was opened and read to its end."""
        return not self.slots and self.next_shard >= len(self.order)

    def read_through(self) -> list[int]:
        """Positions in ``order`` of the shards read to their end this pass."""
        open_now = {slot.position for slot in self.slots}
        return [i for i in range(self.next_shard) if i not in open_now]

    def state_dict(self) -> dict:
        return {"passes": self.passes, "next_shard": self.next_shard, "slots": [s.state() for s in self.slots],
                "turn": self.turn,
                "finished": self.finished, "pass_docs": self.pass_docs, "epoch_docs": self.epoch_docs,
                "dead": self.dead}

    def load_state_dict(self, state: dict, config: JobConfig, epoch: int) -> None:
        self.start_pass(config, epoch, int(state.get("passes", 0)))
        self.next_shard = min(int(state["next_shard"]), len(self.order))
        self.slots = []
        for position, samples, offset in state["slots"]:
            if not 0 <= int(position) < self.next_shard:
                raise ValueError(f"planner state: an open shard at position {position} of {self.next_shard} opened")
            self.slots.append(Slot(int(position), int(samples), None if offset is None else int(offset)))
        self.turn = int(state.get("turn", 0))
        if self.slots and not 0 <= self.turn < len(self.slots):
            raise ValueError(f"planner state: turn {self.turn} of {len(self.slots)} open shards")
        self.finished = bool(state.get("finished", False))
        self.pass_docs = int(state.get("pass_docs", 0))
        self.epoch_docs = int(state.get("epoch_docs", 0))
        self.dead = bool(state.get("dead", False))


def wave_progress(sizes: np.ndarray, samples: int) -> tuple[np.ndarray, int]:
    """How many samples of each shard of one wave (``sizes``, in slot order) are read after
    ``samples`` of the wave, and the turn then (the index among the shards with samples left of
    the next one to read): rounds of one sample per shard with samples left. Closed form: the
    full rounds c are the largest with sum(min(size, c)) <= samples, the rest go to the first
    shards larger than c."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if samples >= int(sizes.sum()):
        return sizes.copy(), 0
    low, high = 0, int(sizes.max())
    while low < high:  # the largest c with sum(min(sizes, c)) <= samples
        mid = (low + high + 1) // 2
        if int(np.minimum(sizes, mid).sum()) <= samples:
            low = mid
        else:
            high = mid - 1
    read = np.minimum(sizes, low)
    rest = samples - int(read.sum())
    larger = np.flatnonzero(sizes > low)
    read[larger[:rest]] += 1
    left = np.flatnonzero(read < sizes)  # the shards still open, in slot order
    turn = int(np.searchsorted(left, larger[rest])) if rest < len(larger) else 0
    return read, turn


def seek_cursor(cursor: DatasetCursor, sizes: np.ndarray, open_shards: int, samples: int) -> None:
    """Moves a cursor whose pass just started to where it stands after ``samples`` samples of the
    pass, given every shard's size (``sizes`` in the dataset's listed order, e.g. from manifests):
    whole waves from a prefix sum, the last one by wave_progress. Exact when every sample gives a
    document (a skipped sample moves the reading on without one)."""
    ordered = np.asarray(sizes, dtype=np.int64)[positions(cursor.order, cursor.urls)]
    wave_sizes = np.add.reduceat(ordered, np.arange(0, len(ordered), open_shards)) if len(ordered) else ordered
    ends = np.cumsum(wave_sizes)
    wave = int(np.searchsorted(ends, samples, side="right"))
    done = int(ends[wave - 1]) if wave else 0
    cursor.pass_docs = cursor.epoch_docs = samples
    if wave >= len(wave_sizes):
        cursor.next_shard, cursor.slots, cursor.turn = len(cursor.order), [], 0
        return
    first = wave * open_shards
    members = ordered[first:first + open_shards]
    read, turn = wave_progress(members, samples - done)
    cursor.next_shard = first + len(members)
    cursor.slots = [Slot(first + i, int(n)) for i, n in enumerate(read) if n < members[i]] if samples > done else []
    cursor.next_shard = cursor.next_shard if cursor.slots else first
    cursor.turn = turn if cursor.slots else 0


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
