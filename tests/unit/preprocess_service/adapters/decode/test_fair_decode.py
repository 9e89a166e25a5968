"""The decode pool's fair queue (adapters/decode/fairqueue.py): streams are served in turn, a microbatch
at a time, whatever each queued, so no stream waits behind another's backlog. Pure: no workers,
no clocks; a unit is a microbatch, its items are its documents, and each encodes its own place."""

from __future__ import annotations

from collections import Counter

import pytest

from preprocess_service.adapters.decode.fairqueue import FairQueue


def _unit(stream: str, number: int, size: int) -> list[tuple[str, int, int]]:
    return [(stream, number, i) for i in range(size)]


def _served_units(queue: FairQueue, pops: int | None = None) -> list[tuple[str, int]]:
    """(stream, unit number) of each unit as its last item leaves, checking a unit's items leave
    together and in order."""
    out: list[tuple[str, int]] = []
    current: tuple[str, int] | None = None
    expected_index = 0
    while len(queue) and (pops is None or len(out) < pops):
        _, (stream, number, index) = queue.pop()
        if index == 0:
            assert expected_index == 0, f"unit {current} was interrupted by {(stream, number)}"
            current = (stream, number)
        assert (stream, number) == current and index == expected_index
        expected_index += 1
        if _is_last(queue, stream, number, index):
            out.append((stream, number))
            expected_index = 0
    return out


def _is_last(queue: FairQueue, stream: str, number: int, index: int) -> bool:
    return not any(entry[-1][:2] == (stream, number) for entry in queue._heap)


def _assert_within_one(served: list[tuple[str, int]], streams: list[str]) -> None:
    counts: Counter = Counter()
    for stream, _ in served:
        counts[stream] += 1
        values = [counts[s] for s in streams]
        assert max(values) - min(values) <= 1, f"after {sum(values)} units: {dict(counts)}"


def test_streams_are_served_in_turn_whatever_order_they_queued_in():
    queue: FairQueue = FairQueue()
    streams = [f"s{i}" for i in range(5)]
    for stream in streams:  # each queues its whole backlog at once, one stream after another
        for number in range(6):
            queue.push(stream, _unit(stream, number, 1 + (number * 7 + len(stream)) % 4))
    served = _served_units(queue)
    assert len(served) == 30
    _assert_within_one(served, streams)
    for stream in streams:  # a stream's own units in the order it queued them
        assert [n for s, n in served if s == stream] == list(range(6))


def test_a_stream_with_a_deep_prefetch_takes_no_more_than_its_share():
    queue: FairQueue = FairQueue()
    for number in range(10):
        queue.push("deep", _unit("deep", number, 3))
    shallow = ["a", "b", "c"]
    next_number = dict.fromkeys(shallow, 0)
    for stream in shallow:  # one microbatch ahead each: a new one when the last is served
        queue.push(stream, _unit(stream, 0, 2))
    served: list[tuple[str, int]] = []
    while len(served) < 24:
        (stream, number), = _served_units(queue, pops=1)
        served.append((stream, number))
        if stream in shallow:
            next_number[stream] += 1
            queue.push(stream, _unit(stream, next_number[stream], 2))
    _assert_within_one(served, ["deep", *shallow])


def test_a_stream_coming_back_is_served_this_round_not_after_the_backlog():
    queue: FairQueue = FairQueue()
    for stream in ("a", "b", "c"):
        for number in range(5):
            queue.push(stream, _unit(stream, number, 2))
    first = _served_units(queue, pops=4)  # a round and a bit
    queue.push("late", _unit("late", 0, 1))  # back from planning, or its client was slow
    rest = _served_units(queue)
    assert rest.index(("late", 0)) <= 3, first + rest  # within the round under way, not 11 units later


def test_an_idle_stream_saves_up_no_credit():
    queue: FairQueue = FairQueue()
    for stream in ("a", "b"):
        for number in range(8):
            queue.push(stream, _unit(stream, number, 1))
    assert len(_served_units(queue, pops=10)) == 10
    for number in range(4):  # "idle" queued nothing for five rounds: it gets no burst now
        queue.push("idle", _unit("idle", number, 1))
    served = _served_units(queue)
    _assert_within_one(served[:9], ["a", "b", "idle"])


def test_a_requeued_item_goes_back_to_its_place():
    queue: FairQueue = FairQueue()
    queue.push("a", _unit("a", 0, 2))
    queue.push("b", _unit("b", 0, 1))
    order, item = queue.pop()
    assert item == ("a", 0, 0)
    queue.requeue(order, item)  # its worker died: retried ahead of later work
    assert [queue.pop()[1] for _ in range(3)] == [("a", 0, 0), ("a", 0, 1), ("b", 0, 0)]
    with pytest.raises(IndexError):
        queue.pop()


def test_an_item_split_on_requeue_keeps_its_place_and_its_parts_their_order():
    """A retried decode task goes back as one task per document, all at the task's place: they
    leave in the order they were requeued, ahead of later work, and items that are not comparable
    (tasks) never need comparing."""
    queue: FairQueue = FairQueue()
    first, second = object(), object()
    queue.push("a", [first])
    queue.push("b", [second])
    order, _ = queue.pop()
    parts = [object() for _ in range(5)]
    for part in parts:
        queue.requeue(order, part)
    assert [queue.pop()[1] for _ in range(6)] == [*parts, second]
    queue.push("a", [first])
    queue.requeue(order, second)
    assert [item for _, item in queue.drain()] == [second, first]


def test_streams_gone_leave_no_state_behind():
    queue: FairQueue = FairQueue()
    for number in range(1000):  # a thousand short streams, one microbatch each
        queue.push(object(), [number])
        assert queue.pop()[1] == number
    assert len(queue._streams) <= 65


def test_streams_keep_their_seats_whatever_order_they_queue_in():
    """Each round serves the streams in one order, so each waits one round between units, not
    none and then two as its place in the queue moves."""
    queue: FairQueue = FairQueue()
    streams = ["a", "b", "c", "d"]
    for stream in streams:
        queue.push(stream, _unit(stream, 0, 1))
    orders = []
    for number in range(1, 6):
        served = _served_units(queue, pops=4)
        orders.append([s for s, _ in served])
        for stream in reversed(served and [s for s, _ in served]):  # next units queued in reverse
            queue.push(stream, _unit(stream, number, 1))
    assert orders == [streams] * 5
