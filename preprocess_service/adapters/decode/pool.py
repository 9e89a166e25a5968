"""DecodePool: the worker processes, their dispatch and supervision; the shared-memory arenas they
decode into are arenas.py's."""

from __future__ import annotations

import collections
import itertools
import logging
import multiprocessing as mp
import os
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from multiprocessing import connection, shared_memory

import numpy as np

from preprocess_service.adapters.decode import forkserver
from preprocess_service.adapters.decode.arenas import Arenas
from preprocess_service.adapters.decode.fairqueue import FairQueue, Order
from preprocess_service.adapters.decode.items import Decoded, missing_reason
from preprocess_service.adapters.decode.shm import CONTROL_BYTES
from preprocess_service.adapters.decode.worker import worker_main
from preprocess_service.adapters.infra import cpus, procmem
from preprocess_service.adapters.infra.budget import UNLIMITED, MemoryBudget, call_once
from preprocess_service.adapters.plugins.hooks import HookCosts, HookSpec, add_costs
from preprocess_service.core.assemble import Layout, aligned

log = logging.getLogger(__name__)
WORKER_DIED = "decode worker died twice while decoding this sample"
MAX_START_FAILURES = 3
"""Workers that exit (or time out) one after another before ever reporting ready: the pool is
broken (an installation problem) and fails its work instead of restarting them forever."""
RECLAIM_EVERY_S = 0.5
"""How often the pool looks for lent arenas their clients let go of, besides at every new microbatch."""
TASK_INPUT_BYTES = 1 << 20
"""Encoded bytes a decode task aims at: a microbatch's documents go to the workers in tasks of
about this much, at least one per worker, so each message's round trip (pickling, pipes and
waking) is small against the decoding it carries."""


@dataclass(slots=True)
class _Batch:
    """One microbatch in the pool: its arena and the documents still being decoded."""

    arena: shared_memory.SharedMemory
    nbytes: int
    remaining: int
    future: futures.Future
    errors: dict[str, str] = field(default_factory=dict)
    spare: int = 0
    """Bytes after the output buffer kept for lend() (the layout's token arrays)."""
    lent: bool = False
    """Its arena was lent: releasing the batch leaves it to _reclaim."""
    hooks: HookSpec | None = None
    """The job's plugins, whose media hooks the workers run on each item."""
    hook_costs: HookCosts = field(default_factory=dict)
    """What those hooks spent on it so far."""


@dataclass(slots=True)
class _Task:
    """Documents of one microbatch a worker decodes in one message: (key, wire items) each."""

    task_id: int
    batch: _Batch
    documents: list[tuple[str, list]]
    attempts: int = 0
    order: Order = (0, 0, 0, 0)
    """Its place in the pool's FairQueue, kept for a retry."""


@dataclass(slots=True)
class _Worker:
    slot: int
    process: mp.Process
    conn: connection.Connection
    started: float
    """time.monotonic() at launch: one not ready ``start_timeout_s`` later is killed."""
    ready: bool = False
    idle_bytes: int | None = None
    """Its proportional set size when it reported ready, before any work (None: not measured)."""
    in_flight: dict[int, _Task] = field(default_factory=dict)


class DecodePool:
    """``num_workers`` decode processes (default: one per CPU this process may use, cgroup quota
    included: infra/cpus.py)."""

    def __init__(self, num_workers: int | None = None, *, max_in_flight: int = 2, start_timeout_s: float = 120.0,
                 budget: MemoryBudget = UNLIMITED, wait: bool = True):
        """``wait``: return once every worker is ready (RuntimeError if they cannot start);
        False: return at once while they start (``wait_ready()`` waits)."""
        self.budget = budget
        """Every arena is charged to it from creation to destruction (/dev/shm holds it meanwhile)."""
        self.num_workers = num_workers or cpus.available_cpus()
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self.max_in_flight = max_in_flight
        self.start_timeout_s = start_timeout_s
        # The fork server is a fresh interpreter: no forked copies of this process's gRPC threads or locks.
        self._ctx = forkserver.context()  # started here unless forkserver.start() ran earlier
        self._lock = threading.Lock()
        self._ready_changed = threading.Condition(self._lock)
        self._start_failures = 0
        self._broken: str | None = None
        self._pending: FairQueue[_Task] = FairQueue()
        self._in_pool: collections.Counter = collections.Counter()
        """Stream -> its microbatches submitted and not finished yet (others_decoding)."""
        self._task_ids = itertools.count()
        self._trim_requested = False
        self._counters = collections.Counter()
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        self.arenas = Arenas(self._lock, budget, keep=2 * self.num_workers + 4,
                             wake=lambda: os.write(self._wake_w, b"x"))
        budget.reclaimable = self.arenas.idle_bytes
        self._workers: list[_Worker] = []
        """By slot; filled as the workers start (_start_all, on the starter thread)."""
        self._starter = threading.Thread(target=self._start_all, name="decode-start", daemon=True)
        self._thread = threading.Thread(target=self._dispatch_loop, name="decode-dispatch", daemon=True)
        self._thread.start()
        if wait:
            try:
                self.wait_ready(MAX_START_FAILURES * (start_timeout_s + 10))  # slow starters are killed
            except BaseException:
                self.close()
                raise

    # --- workers ------------------------------------------------------------------------------
    def _start_all(self) -> None:
        """Starts the workers, on a thread of their own: the first start waits while the fork server
        imports torch and the decoders (about a CPU-second), which must hold up neither the caller
        nor the dispatcher (it breaks the pool if this takes more than start_timeout_s). Stops early
        if the pool cannot start or was closed."""
        for slot in range(self.num_workers):
            try:
                worker = self._start_worker(slot)
            except Exception as exc:  # e.g. the fork server cannot start
                self._break(f"decode workers cannot start: {type(exc).__name__}: {exc}")
                return
            with self._lock:
                closed = self._closed
                if not closed:
                    self._workers.append(worker)
                    os.write(self._wake_w, b"x")  # the dispatcher waits on its pipe (close() closes it later)
            if closed:
                worker.process.kill()
                worker.process.join(timeout=5)
                worker.conn.close()
                return

    def _start_worker(self, slot: int) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=worker_main, args=(child, slot), name=f"decode-{slot}", daemon=True)
        process.start()
        child.close()
        return _Worker(slot, process, parent, time.monotonic())

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Blocks until every worker is ready; RuntimeError if the pool is broken (workers keep
        exiting while they start) or ``timeout_s`` passes first."""
        with self._ready_changed:
            done = self._ready_changed.wait_for(
                lambda: self._broken is not None or self._closed or (
                    len(self._workers) == self.num_workers and all(w.ready for w in self._workers)), timeout_s)
            if self._broken is not None:
                raise RuntimeError(self._broken)
            if not done:
                raise RuntimeError(f"decode workers did not start within {timeout_s:g} s")

    def idle_memory(self) -> int | None:
        """The workers' memory when each reported ready, idle (what the memory budget's baseline
        counts for them); None until every worker has been measured or where /proc cannot be read."""
        with self._lock:
            sizes = [w.idle_bytes for w in self._workers]
        return None if len(sizes) < self.num_workers or None in sizes else sum(sizes)

    def worker_pids(self) -> list[int]:
        with self._lock:
            return [w.process.pid for w in self._workers]

    def in_flight(self) -> dict[int, list[str]]:
        """Worker pid -> keys of the documents it is decoding now."""
        with self._lock:
            return {w.process.pid: [key for t in w.in_flight.values() for key, _ in t.documents]
                    for w in self._workers}

    def stats(self) -> dict:
        with self._lock:
            return {"workers": self.num_workers, "pending": len(self._pending), "arenas": len(self.arenas.all),
                    "lent": len(self.arenas.lent_arenas), **self._counters, **self.arenas.counters}

    def trim_workers(self) -> None:
        """Asks every decode worker to give its freed heap back to the system now (the server is
        short of memory); they also do at once whenever they idle."""
        with self._lock:
            self._trim_requested = True
        os.write(self._wake_w, b"x")

    # --- submitting ---------------------------------------------------------------------------
    def submit(self, layout: Layout, stop: threading.Event | None = None, hooks: HookSpec | None = None) \
            -> futures.Future:
        """Decodes ``layout``'s documents into a shared buffer; the future gives a Decoded. Waits
        for room in the memory budget (ResourceExhausted past its wait, or once ``stop`` is set).
        ``stop`` also names the stream: microbatches submitted with one event are one stream's,
        and streams are served in turn (fairqueue.py); without one, each is its own stream."""
        future: futures.Future = futures.Future()
        inputs = [(doc, items) for doc, items in layout.documents if items]
        in_nbytes = sum(len(doc.media_bytes[i.member])
                        for doc, items in inputs if not missing_reason(doc) for i in items)
        spare = sum(aligned(a.nbytes) for a in layout.arrays.values())
        arena = self.arenas.acquire(CONTROL_BYTES + layout.nbytes + spare + in_nbytes, stop)
        batch = _Batch(arena, layout.nbytes, 0, future, spare=spare, hooks=hooks)
        view = arena.buf
        cursor, documents = CONTROL_BYTES + layout.nbytes + spare, []
        for doc, items in inputs:
            problem = missing_reason(doc)
            if problem:
                batch.errors[doc.key] = problem
                continue
            wire_items, start = [], cursor
            for item in items:
                data = doc.media_bytes[item.member]
                view[cursor:cursor + len(data)] = data
                wire_items.append((cursor, len(data), item))
                cursor += len(data)
            documents.append((doc.key, wire_items, cursor - start))
        del view
        tasks = [_Task(next(self._task_ids), batch, chunk)
                 for chunk in _chunks(documents, self.num_workers, TASK_INPUT_BYTES)]
        batch.remaining = len(tasks)
        if not tasks:
            self._finish(batch)
            return future
        stream = stop if stop is not None else object()
        with self._lock:
            refused = self._broken or ("the decode pool is closed" if self._closed else None)
            if refused is None:
                self._pending.push(stream, tasks)
                self._in_pool[stream] += 1
        if refused is not None:
            self.arenas.release(arena)
            raise RuntimeError(refused)
        future.add_done_callback(lambda _: self._left_pool(stream))  # decoded, failed or closed
        os.write(self._wake_w, b"x")
        return future

    def _left_pool(self, stream) -> None:
        with self._lock:
            self._in_pool[stream] -= 1
            if self._in_pool[stream] <= 0:
                del self._in_pool[stream]

    def others_decoding(self, stop: threading.Event | None) -> bool:
        """Whether a stream other than ``stop``'s has microbatches in the pool, waiting or being
        decoded: work that keeps the workers busy while that stream lays out its next microbatch
        (streams.py decodes one ahead only when none has)."""
        with self._lock:
            return len(self._in_pool) > (stop in self._in_pool)

    def _finish(self, batch: _Batch) -> None:
        buffer = np.ndarray((batch.nbytes,), dtype=np.uint8, buffer=batch.arena.buf, offset=CONTROL_BYTES)
        lendable = not batch.errors and self.arenas.lendable(batch.arena)
        batch.future.set_result(Decoded(buffer, batch.errors, call_once(lambda: self._release_batch(batch)),
                                        lend=(lambda arrays: self.arenas.lend(batch, arrays)) if lendable else None,
                                        hook_costs=batch.hook_costs))

    def _release_batch(self, batch: _Batch) -> None:
        with self._lock:
            lent = batch.lent
        if not lent:
            self.arenas.release(batch.arena)

    # --- the dispatcher thread ----------------------------------------------------------------
    def _dispatch_loop(self) -> None:
        try:
            self._dispatch()
        except Exception as exc:  # a bug: fail the waiting work and later submits, never leave them hanging
            log.exception("decode dispatch failed")
            self._break(f"the decode pool's dispatcher failed: {type(exc).__name__}: {exc}")

    def _dispatch(self) -> None:
        starter = self._starter
        starter_deadline = time.monotonic() + self.start_timeout_s
        starter.start()
        last_reclaim = time.monotonic()
        while True:
            with self._lock:
                if self._closed:
                    return
                self._send_pending()
                live = self._workers if self._broken is None else []  # a broken pool waits for close()
                waits = {w.conn: w for w in live}
                deaths = {w.process.sentinel: w for w in live}
                starting = [w.started + self.start_timeout_s for w in live if not w.ready]
                if self._broken is None and starter.is_alive():  # a fork server that hangs must not hang the work
                    starting.append(starter_deadline)
                if self.arenas.lent_arenas:  # clients let go of lent arenas without a word: look now and then
                    starting.append(last_reclaim + RECLAIM_EVERY_S)
            timeout = max(0.0, min(starting) - time.monotonic()) + 0.01 if starting else None
            ready = connection.wait([self._wake_r, *waits, *deaths], timeout)
            for obj in ready:
                if obj == self._wake_r:
                    os.read(self._wake_r, 4096)
                elif obj in waits:
                    self._receive(waits[obj])
                else:
                    self._replace(deaths[obj])
            self._kill_slow_starters()
            if time.monotonic() - last_reclaim > RECLAIM_EVERY_S:
                self.arenas.reclaim()
                last_reclaim = time.monotonic()
            if self._broken is None and starter.is_alive() and time.monotonic() > starter_deadline:
                self._break(f"decode workers cannot start: {len(self._workers)} of {self.num_workers} were started "
                            f"within start_timeout_s {self.start_timeout_s:g} s (the fork server hangs?)")

    def _kill_slow_starters(self) -> None:
        """A worker not ready start_timeout_s after launch is killed; its death is a start failure."""
        now = time.monotonic()
        with self._lock:
            slow = [w for w in self._workers if not w.ready and now - w.started > self.start_timeout_s]
        for worker in slow:
            log.warning("decode worker %d (pid %s) did not start within %g s; killed", worker.slot,
                        worker.process.pid, self.start_timeout_s)
            worker.process.kill()

    def _send_pending(self) -> None:
        """Hands waiting tasks to workers with room (caller holds the lock). Messages are a few
        hundred bytes, far below the pipe's buffer, so send never blocks on a busy worker."""
        messages = []
        dropped = self.arenas.take_dropped()
        if dropped:
            messages.append(("drop", dropped))
        if self._trim_requested:
            messages.append(("trim",))
            self._trim_requested = False
        for message in messages:
            for worker in self._workers:
                if worker.ready:  # one that is starting maps none yet
                    try:
                        worker.conn.send(message)
                    except (BrokenPipeError, OSError):
                        pass
        for worker in sorted(self._workers, key=lambda w: len(w.in_flight)):
            while worker.ready and self._pending and len(worker.in_flight) < self.max_in_flight:
                order, task = self._pending.pop()
                task.order = order
                task.attempts += 1
                worker.in_flight[task.task_id] = task
                try:
                    worker.conn.send((task.task_id, task.batch.arena.name, task.documents, task.batch.hooks))
                except (BrokenPipeError, OSError):
                    break  # dead: its sentinel fires next and the task is retried

    def _receive(self, worker: _Worker) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            return  # the sentinel reports the death
        if message[0] == "ready":
            if time.monotonic() - worker.started > self.start_timeout_s:
                # read past its deadline (the dispatcher may read a little late): too slow, as the
                # rule says, whatever raced here first; _kill_slow_starters kills it next
                return
            idle = procmem.pss_bytes([worker.process.pid])  # before any work is dispatched to it
            with self._lock:
                worker.ready = True
                worker.idle_bytes = idle
                self._start_failures = 0
                self._ready_changed.notify_all()
            return
        task_id, errors, costs = message
        with self._lock:
            task = worker.in_flight.pop(task_id, None)
        if task is not None:
            self._complete(task, errors, costs)

    def _complete(self, task: _Task, errors: list[tuple[str, str]], costs: HookCosts) -> None:
        """``task`` is done; ``errors``: (key, why) of its documents that failed; ``costs``: what
        the job's media hooks spent on it."""
        batch = task.batch
        with self._lock:
            self._counters["documents_decoded"] += len(task.documents) - len(errors)
            self._counters["documents_failed"] += len(errors)
            batch.errors.update(errors)
            add_costs(batch.hook_costs, costs)
            batch.remaining -= 1
            done = batch.remaining == 0
        if done:
            self._finish(batch)

    def _replace(self, worker: _Worker) -> None:
        """A worker died: collect what it did finish, start its successor, retry the rest once."""
        while True:
            try:
                if not worker.conn.poll():
                    break
                message = worker.conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "ready":  # one never read while it lived was not ready: a start failure
                continue
            task_id, errors, costs = message
            task = worker.in_flight.pop(task_id, None)
            if task is not None:
                self._complete(task, errors, costs)
        worker.process.join(timeout=5)  # reap it, for the exit code
        exitcode = worker.process.exitcode
        worker.conn.close()
        with self._lock:
            if self._closed:
                return
            lost = list(worker.in_flight.values())
            worker.in_flight.clear()
            self._counters["worker_restarts"] += 1
        if not worker.ready:
            self._start_failed(worker, exitcode)
            return
        log.warning("decode worker %d (pid %d) died with exit code %s; %d document(s) in flight",
                    worker.slot, worker.process.pid, exitcode, sum(len(t.documents) for t in lost))
        successor = self._start_worker(worker.slot)  # ready in the background; work waits for it
        retry = []
        for task in lost:
            if task.attempts >= 2:
                self._complete(task, [(key, f"{WORKER_DIED} (exit code {exitcode})") for key, _ in task.documents],
                               {})
                continue
            # Retried one document per task: the one that kills a worker again fails alone.
            retry += [_Task(next(self._task_ids), task.batch, [document], task.attempts, task.order)
                      for document in task.documents]
            with self._lock:
                task.batch.remaining += len(task.documents) - 1
        with self._lock:
            self._counters["documents_retried"] += len(retry)
            for task in retry:
                self._pending.requeue(task.order, task)
            self._workers[worker.slot] = successor

    def _start_failed(self, worker: _Worker, exitcode) -> None:
        """A worker exited before it was ready: start another, or after MAX_START_FAILURES in a
        row give up and fail every waiting microbatch (a pool that cannot start must not hang)."""
        with self._lock:
            self._start_failures += 1
            if self._start_failures < MAX_START_FAILURES:
                self._workers[worker.slot] = self._start_worker(worker.slot)
                return
        self._break(f"decode workers cannot start: {self._start_failures} exited one after another before they "
                    f"were ready (last exit code {exitcode}; the server log has their errors)")

    def _break(self, reason: str) -> None:
        """The pool cannot work: every waiting microbatch fails with ``reason``, and so do later submits."""
        with self._lock:
            self._broken = reason
            waiting = self._take_waiting()
            self._ready_changed.notify_all()
        log.error("%s", self._broken)
        self._fail(waiting, reason)

    def _take_waiting(self) -> list[_Task]:
        """Every task not finished yet, waiting or in a worker (caller holds the lock)."""
        waiting = [task for _, task in self._pending.drain()]
        return waiting + [t for w in self._workers for t in w.in_flight.values()]

    def _fail(self, tasks: list[_Task], reason: str) -> None:
        """Fails the microbatches of ``tasks`` with ``reason`` (their arenas go back)."""
        for batch in {id(t.batch): t.batch for t in tasks}.values():
            if not batch.future.done():
                batch.future.set_exception(RuntimeError(reason))
                self.arenas.release(batch.arena)

    def close(self) -> None:
        """Stops the workers, fails the microbatches still being decoded (whoever waits for them
        must not wait forever) and frees every arena."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self._workers)
            waiting = self._take_waiting()
        self._fail(waiting, "the decode pool is closed")
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        if self._starter.is_alive():
            self._starter.join(timeout=5)  # a worker it starts now is killed there (the pool is closed)
        for worker in workers:
            try:
                worker.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for worker in workers:
            worker.process.join(timeout=5)
            if worker.process.is_alive():
                worker.process.kill()
        self.arenas.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


def _chunks(documents: list[tuple[str, list, int]], num_workers: int,
            target_bytes: int) -> list[list[tuple[str, list]]]:
    """``documents`` ((key, wire items, encoded bytes) each, in order) cut into consecutive tasks of
    about equal encoded bytes: one per ``target_bytes``, at least one per worker (so a microbatch
    is decoded by every worker), at most one per document. A document goes to the task its middle
    byte falls in (one larger than a task's share leaves the task before it empty, and dropped)."""
    if not documents:
        return []
    total = sum(nbytes for _, _, nbytes in documents)
    count = min(len(documents), max(num_workers, -(-total // max(1, target_bytes))))
    chunks: list[list[tuple[str, list]]] = [[] for _ in range(count)]
    cumulative = 0
    for index, (key, items, nbytes) in enumerate(documents):
        middle = (2 * cumulative + nbytes, 2 * total) if total else (index, len(documents))
        chunks[min(count - 1, count * middle[0] // middle[1])].append((key, items))
        cumulative += nbytes
    return [chunk for chunk in chunks if chunk]
