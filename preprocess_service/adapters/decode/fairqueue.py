"""The decode pool's waiting room: work of many streams served in turn (start-time fair queueing).

Every stream (a rank's microbatch stream) must receive its microbatches at the same pace, since a
synchronous training step waits for its slowest rank. Served first come, first served, a stream
that submits two microbatches back to back gets them back to back, and then waits a whole queue
for the next two; one that comes back after a pause (planning, a slow client) waits behind every
other stream's backlog. Here each unit of work (a microbatch: a list of items, its documents)
gets a tag: one more than its stream's previous unit, or the current round if the stream had
fallen behind it (no credit is saved up while idle). Items leave in tag order, a unit's items
together, so each round serves every waiting stream one unit, whatever its cost and however many
units it queued. Within a round streams keep their seats (the order they first came in), not
the order they queued in: a stream served last in one round and first in the next would get
two units at once and then wait two rounds. Only the order of work changes, never what a unit
holds.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
Order = tuple[int, int, int, int]
"""(tag, seat of its stream, unit number, item index): an item's place in the queue."""


class FairQueue(Generic[T]):
    """Items of units of many streams; ``pop`` gives them in fair order. Not thread-safe."""

    def __init__(self) -> None:
        self._heap: list[tuple[Order, int, T]] = []
        """(order, ticket, item): the ticket keeps items requeued at one place in the order they came."""
        self._tickets = itertools.count()
        self._units = itertools.count()
        self._seats = itertools.count()
        self._streams: dict[Hashable, tuple[int, int]] = {}
        """Stream -> (tag of its next unit, its seat)."""
        self._round = 0
        """The tag of the latest item taken: a stream that comes back starts here."""

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, stream: Hashable, items: Sequence[T]) -> None:
        """Queues one unit of ``stream``: it is served after the stream's earlier units, in a
        later round than them."""
        if not items:
            return
        next_tag, seat = self._streams.get(stream) or (0, next(self._seats))
        tag = max(next_tag, self._round)
        self._streams[stream] = (tag + 1, seat)
        unit = next(self._units)
        for index, item in enumerate(items):
            heapq.heappush(self._heap, ((tag, seat, unit, index), next(self._tickets), item))
        if len(self._streams) > 4 * len(self._heap) + 64:
            self._forget_idle()

    def pop(self) -> tuple[Order, T]:
        """The next item and its place (IndexError when empty)."""
        order, _, item = heapq.heappop(self._heap)
        self._round = max(self._round, order[0])
        return order, item

    def requeue(self, order: Order, item: T) -> None:
        """Puts back an item taken by ``pop`` (a retry) at its old place: ahead of later work. Items
        requeued at one place (the parts of a split item) leave in the order they were requeued."""
        heapq.heappush(self._heap, (order, next(self._tickets), item))

    def drain(self) -> list[tuple[Order, T]]:
        """Takes every queued item out, in order (the queue is empty afterwards)."""
        items = [(order, item) for order, _, item in sorted(self._heap, key=lambda entry: entry[:2])]
        self._heap.clear()
        return items

    def _forget_idle(self) -> None:
        """Drops the entries of streams with nothing queued past the next round, so a server that
        saw many streams keeps no state for those gone (at most one more than the items queued).
        Such a stream, if it comes back, is served as a new one: at worst one unit early."""
        self._streams = {s: entry for s, entry in self._streams.items() if entry[0] > self._round + 1}
