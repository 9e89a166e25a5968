"""The memory budget serves waiting charges in arrival order: a large charge is not starved by a
stream of small ones, a holder that must grow before it can free does not deadlock the queue, and a
charge that can never fit, or waits too long, fails with a clear error and blocks nobody after.

The schedules are controlled, not raced: where a test must show what happens when a small charge
is returned and taken again before the waiting thread runs (the worst case, which a loaded machine
produces now and then), it holds the budget's lock across both, so no thread can run in between."""

from __future__ import annotations

import threading
import time

import pytest

from disttrain_api.errors import ResourceExhausted
from preprocess_service.adapters.infra import budget as budget_module
from preprocess_service.adapters.infra.budget import MemoryBudget

pytestmark = pytest.mark.unit


class Waiting(threading.Thread):
    """reserve(nbytes) in a thread of its own; ``granted`` once it holds them, ``error`` if it failed."""

    def __init__(self, budget: MemoryBudget, nbytes: int, what: str, order: list | None = None):
        super().__init__(daemon=True, name=f"reserve-{what}")
        self.budget, self.nbytes, self.what, self.order = budget, nbytes, what, order
        self.granted = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.budget.reserve(self.nbytes, what=self.what)
        except BaseException as exc:
            self.error = exc
            return
        if self.order is not None:
            self.order.append(self.what)
        self.granted.set()


def _queued(budget: MemoryBudget, count: int) -> None:
    """Waits until ``count`` charges wait for room (each thread has entered the queue)."""
    deadline = time.monotonic() + 30
    while budget.waiting < count:
        assert time.monotonic() < deadline, f"{budget.waiting} charges waiting, expected {count}"
        time.sleep(0.005)


def test_a_large_charge_is_not_starved_by_a_stream_of_small_ones():
    budget = MemoryBudget(100, wait_s=30)
    for _ in range(9):
        budget.reserve(10, what="a small message")  # a stream holds 90 in pieces of 10
    arena = Waiting(budget, 20, "a decode arena")
    arena.start()
    _queued(budget, 1)
    refused = 0
    for _ in range(50):
        # the stream returns a piece and asks for the next before the arena's thread can run
        with budget._cond:
            budget.release(10)
            if budget.try_reserve(10):
                continue
            refused += 1
        break
    assert arena.granted.wait(10), "the arena never got the room the small charges kept taking"
    assert refused == 1 and budget.used == 100 and budget.waiting == 0
    budget.release(20)
    assert budget.try_reserve(10)  # nobody waits: room goes to whoever asks


def test_waiting_charges_are_served_in_arrival_order():
    budget = MemoryBudget(100, wait_s=30)
    budget.reserve(100, what="all of it")
    order: list[str] = []
    threads = []
    for nbytes, what in ((30, "first"), (10, "second"), (30, "third")):
        thread = Waiting(budget, nbytes, what, order)
        thread.start()
        threads.append(thread)
        _queued(budget, len(threads))
    assert not budget.try_reserve(1) and not budget.try_cache(1), "a new charge went ahead of waiting ones"
    budget.release(30)  # room for the first (or for the second and most of the third: not theirs yet)
    assert threads[0].granted.wait(10)
    assert budget.waiting == 2 and not threads[1].granted.is_set()
    budget.release(25)  # room for the second, not yet for the third
    assert threads[1].granted.wait(10)
    assert budget.waiting == 1 and not threads[2].granted.is_set()
    budget.release(15)
    assert threads[2].granted.wait(10)
    assert order == ["first", "second", "third"] and budget.used == 100


def test_a_holder_that_must_grow_before_it_frees_does_not_deadlock_the_queue(monkeypatch):
    monkeypatch.setattr(budget_module, "STALL_S", 0.05)
    budget = MemoryBudget(100, wait_s=30)
    budget.reserve(90, what="a stream's last message")
    arena = Waiting(budget, 20, "a decode arena")
    arena.start()
    _queued(budget, 1)
    # the stream frees its last message only once its next is charged: behind the arena, which
    # waits for that very room, a strict queue would hold both until wait_s
    budget.reserve(10, what="the stream's next message")
    assert budget.bypassed == 1 and not arena.granted.is_set()
    budget.release(90)
    assert arena.granted.wait(10) and budget.used == 30


def test_a_charge_that_can_never_fit_fails_at_once_and_one_that_waits_too_long_blocks_nobody():
    budget = MemoryBudget(1000, wait_s=0.3)
    budget.set_baseline(400)  # room for data: 600, less the 10% headroom
    with pytest.raises(ResourceExhausted, match=r"a decode arena needs 541 bytes.*whole memory budget.*540"):
        budget.reserve(541, what="a decode arena")
    budget.reserve(500, what="most of it")
    huge = Waiting(budget, 100, "a large arena")
    huge.start()
    _queued(budget, 1)
    budget.wait_s = 30.0  # the one behind waits longer: it is served once the large one gives up
    small = Waiting(budget, 30, "a small message")
    small.start()
    _queued(budget, 2)
    huge.join(10)
    assert isinstance(huge.error, ResourceExhausted) and "a large arena needs 100" in str(huge.error)
    assert huge.error.retry_after_s
    assert small.granted.wait(10), "the charge behind one that gave up was never served"
    assert budget.used == 530 and budget.waiting == 0


class FakeClock:
    """budget.time with a monotonic clock the test moves (sleep and the rest pass through)."""

    def __init__(self):
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str):
        return getattr(time, name)


def test_a_charge_whose_wait_is_over_leaves_the_queue_before_its_thread_runs(monkeypatch):
    """On a loaded machine the thread of a charge whose wait is over may not run for a while; the
    charge behind it must not wait for that thread (it gave up with its own wait in a CI run)."""
    clock = FakeClock()
    monkeypatch.setattr(budget_module, "time", clock)
    budget = MemoryBudget(100, wait_s=0.3)
    budget.reserve(80, what="held")
    huge = Waiting(budget, 50, "a large arena")
    huge.start()
    _queued(budget, 1)
    budget.wait_s = 60.0
    small = Waiting(budget, 10, "a small message")
    small.start()
    _queued(budget, 2)
    with budget._cond:  # no waiting thread runs in here: only what the budget does for itself
        clock.now += 1.0  # past the large charge's wait, well inside the small one's
        budget._serve()
        assert budget.waiting == 0, "the charge behind one whose wait was over stayed queued"
    assert small.granted.wait(10) and budget.used == 90
    huge.join(10)
    assert isinstance(huge.error, ResourceExhausted) and "a large arena needs 50" in str(huge.error)


def test_a_cancelled_waiter_leaves_the_queue_to_the_next():
    budget = MemoryBudget(100, wait_s=30)
    budget.reserve(95, what="held")
    stop = threading.Event()
    errors: list[BaseException] = []

    def cancelled() -> None:
        try:
            budget.reserve(50, what="a cancelled stream's arena", stop=stop)
        except ResourceExhausted as exc:
            errors.append(exc)
    thread = threading.Thread(target=cancelled, daemon=True)
    thread.start()
    _queued(budget, 1)
    small = Waiting(budget, 5, "a small message")
    small.start()
    _queued(budget, 2)
    stop.set()
    thread.join(10)
    assert errors and small.granted.wait(10) and budget.used == 100
