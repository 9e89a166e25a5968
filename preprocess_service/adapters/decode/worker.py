"""The body of a decode worker process: receive tasks, decode into shared-memory arenas, reply."""

from __future__ import annotations

import collections
import importlib
import os
import time
from multiprocessing import shared_memory

from preprocess_service.adapters.decode.items import decode_into, warm_up_decoders
from preprocess_service.adapters.decode.shm import CONTROL_BYTES
from preprocess_service.adapters.plugins.hooks import MediaHooks, PluginFailed

MAX_ATTACHED = 64
"""Arenas a worker keeps mapped (reused arenas then cost no page faults); the pool names those it drops."""
TRIM_EVERY_S = 5.0
"""A busy decode worker gives its freed heap back to the system this often."""
IDLE_TRIM_S = 0.2
"""A decode worker with nothing to do for this long gives its freed heap back at once."""
TRIM_ABOVE_BYTES = 64 << 20
"""A busy decode worker whose malloc holds more than this free after a task gives it back at once.
Below it, what its decoders freed stays for the next task to reuse: given back after every task,
each decode would fault its buffers in again (a camera photo's decode leaves tens of MiB free;
``bench/decode.py --only trim`` measures what trimming them costs in page faults and CPU, figures
in docs/benchmarks.md). What is kept is bounded by this, resident and so seen by the memory budget
at its next sample; under pressure the budget has every worker give it back at once
(DecodePool.trim_workers), and an idle worker gives it back after IDLE_TRIM_S."""


def worker_main(conn, worker_id: int) -> None:
    """Body of a decode worker: receive (task id, arena, items), decode into the arena, reply."""
    import torch

    torch.set_num_threads(1)  # one process per core: intra-op threads would only contend
    for module in ("preprocess_service.adapters.media.audio", "preprocess_service.adapters.media.imaging",
                   "preprocess_service.adapters.media.video"):
        importlib.import_module(module)  # every decoder loaded before "ready"
    warm_up_decoders()

    from disttrain_api.heap import free_heap_bytes, trim_malloc

    arenas: collections.OrderedDict[str, shared_memory.SharedMemory] = collections.OrderedDict()
    conn.send(("ready", worker_id, os.getpid()))
    last_trim, dirty = time.monotonic(), False
    while True:
        # Decoders free large buffers; the heap goes back to the system every TRIM_EVERY_S while
        # busy and as soon as the worker idles (an idle worker holding freed heap would keep the
        # server's memory budget from ever seeing it again, and streams waiting for it starve).
        if dirty and (time.monotonic() - last_trim > TRIM_EVERY_S or (free_heap_bytes() or 0) > TRIM_ABOVE_BYTES):
            trim_malloc()
            last_trim, dirty = time.monotonic(), False
        try:
            if dirty and not conn.poll(IDLE_TRIM_S):
                trim_malloc()
                last_trim, dirty = time.monotonic(), False
                continue
            message = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if message is None:
            return
        if message[0] == "drop":  # arenas the parent destroyed or gave away: let their memory go
            for name in message[1]:
                _detach(arenas, name)
            continue
        if message[0] == "trim":  # the server is short of memory
            trim_malloc()
            last_trim, dirty = time.monotonic(), False
            continue
        dirty = True
        task_id, arena_name, documents, hook_spec = message
        errors = []
        try:
            buffer = _attach(arenas, arena_name).buf
        except Exception as exc:  # every document of the task fails with it; the worker carries on
            conn.send((task_id, [(key, f"{type(exc).__name__}: {exc}") for key, _ in documents], {}))
            continue
        hooks, leaked = None, False
        for key, items in documents:
            try:
                if hook_spec is not None and hooks is None:
                    hooks = MediaHooks(hook_spec, hold_memory=True)  # this process's one working thread
                for in_offset, in_nbytes, item in items:
                    data = bytes(buffer[in_offset:in_offset + in_nbytes])
                    decode_into(buffer, item, data, CONTROL_BYTES, hooks, key)
            except (MemoryError, ImportError):
                raise
            except PluginFailed as exc:  # a plugin's fault: this document fails with its reason
                errors.append((key, str(exc)))
                leaked = leaked or "budget" in str(exc)
            except Exception as exc:  # reported for this document; the worker carries on
                errors.append((key, f"{type(exc).__name__}: {exc}"))
        del buffer
        conn.send((task_id, errors, hooks.take_costs() if hooks is not None else {}))
        if leaked:  # what a plugin leaked goes with the process; the pool starts another
            return


def _attach(arenas: collections.OrderedDict, name: str) -> shared_memory.SharedMemory:
    shm = arenas.get(name)
    if shm is None:
        shm = arenas[name] = shared_memory.SharedMemory(name=name)
        while len(arenas) > MAX_ATTACHED:  # the parent tells us what it drops; this bounds the rest
            _detach(arenas, next(iter(arenas)))
    arenas.move_to_end(name)
    return shm


def _detach(arenas: collections.OrderedDict, name: str) -> None:
    shm = arenas.pop(name, None)
    if shm is not None:
        try:
            shm.close()
        except BufferError:
            pass
