"""SampleHooks: a job's sample hooks run in a worker process of their own, supervised.

Parsing (planning, and a replica rebuilding a planned document) happens in the service's
threads; the hooks it calls run in a child process (started from the decode pool's fork server),
one sample per round trip: its large members (the media's bytes) copied into a shared-memory
object the parent owns and only writes, the rest pickled through the pipe, and back only what the
hooks changed, with the CPU each hook took (HookCosts). The child enforces each hook's time limit
and memory budget itself (hooks.call_bounded); the parent is the backstop: a child that does not
answer within the limit plus GRACE_S, grows past its budget while it works, or dies, is killed and
replaced, and the sample fails with that reason. Nothing a hook does reaches the service's own process.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import NamedTuple

from disttrain_api.errors import SampleError
from disttrain_api.plugins import Skip
from preprocess_service.adapters.decode import forkserver, shm
from preprocess_service.adapters.infra import procmem
from preprocess_service.adapters.plugins.hooks import (
    HookCost,
    HookCosts,
    HookSpec,
    PluginFailed,
    sample_changes,
    wanted_members,
)

log = logging.getLogger(__name__)
GRACE_S = 2.0
"""How long past a hook's time limit the parent waits before it kills the child."""
POLL_S = 0.05
"""How often the parent looks at the child's memory while it works."""
START_TIMEOUT_S = 120.0
EXIT_AFTER = "exit"
SHARED_MIN_BYTES = 4096
"""A member this big or bigger crosses to the worker through shared memory (InShared)."""
SHARED_MIN_SIZE = 1 << 20
SHARED_MAX_BYTES = 256 << 20
"""A sample whose large members hold more goes through the pipe (the object stays this small)."""
NO_ROOM_RETRY_S = 60.0
"""After /dev/shm had no room for the object, samples go through the pipe this long before it is tried again."""


class InShared(NamedTuple):
    """A member's bytes, left in the parent's shared-memory object at ``offset``: a large member
    crosses as one copy in and one out, not pickled through the pipe."""

    offset: int
    size: int


def _unpacked(sample: dict, shared: shared_memory.SharedMemory | None) -> dict:
    """``sample`` with its InShared members read back as bytes."""
    if shared is None:
        return sample
    buf = shared.buf
    return {k: bytes(buf[v.offset:v.offset + v.size]) if type(v) is InShared else v for k, v in sample.items()}


def host_main(conn) -> None:
    """The child: (spec, sample, shared-memory name or "") -> ("ok", (changed, removed), costs) |
    ("skip", reason, costs) | ("failed", reason, costs), costs being what each hook spent on the
    sample (HookCosts)."""
    conn.send(("ready",))
    shared: shared_memory.SharedMemory | None = None
    while True:
        try:
            message = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if message is None:
            return
        spec, sample, name = message
        costs: HookCosts = {}
        try:
            if name and (shared is None or shared.name != name):
                if shared is not None:
                    shared.close()
                shared = shared_memory.SharedMemory(name=name)
            changes = sample_changes(spec, _unpacked(sample, shared if name else None), costs)
        except Skip as skip:
            conn.send(("skip", str(skip.reason)[:1000], costs))
        except PluginFailed as exc:
            conn.send(("failed", str(exc), costs))
            if "budget" in str(exc) or "out of memory" in str(exc):
                return  # what it leaked goes with the process; the parent starts another
        except Exception as exc:  # a bug in the checks: this sample's
            conn.send(("failed", f"sample hooks failed: {type(exc).__name__}: {str(exc)[:300]}", costs))
        else:
            try:
                conn.send(("ok", changes, costs))
            except Exception as exc:  # an unpicklable result: this sample's
                conn.send(("failed", f"sample hooks failed: {type(exc).__name__}: {str(exc)[:300]}", costs))


class SampleHooks:
    """Runs ``spec``'s sample hooks on samples (thread-safe: one sample at a time)."""

    def __init__(self, spec: HookSpec, on_costs: Callable[[HookCosts], None] | None = None):
        self.spec = spec
        self.on_costs = on_costs
        """Told what the hooks spent on each sample (the job's PluginCosts)."""
        self._lock = threading.Lock()
        self._process = None
        self._conn = None
        self._wanted = wanted_members(spec)
        self._shared: shared_memory.SharedMemory | None = None
        """Where large members cross to the worker (grown as a sample needs, up to SHARED_MAX_BYTES)."""
        self._no_room_until = 0.0
        """time.monotonic() before which samples go through the pipe (/dev/shm was full)."""
        self.starts = 0
        """Worker processes started (the first, and one after each kill or death)."""

    def _packed(self, sample: dict) -> tuple[dict, str]:
        """``sample`` with its large members copied into the shared-memory object (InShared), and
        that object's name; or ``sample`` and "" when none is large or they do not fit."""
        large = [(k, v) for k, v in sample.items() if isinstance(v, (bytes, bytearray)) and len(v) >= SHARED_MIN_BYTES]
        total = sum(len(v) for _, v in large)
        if not large or total > SHARED_MAX_BYTES or time.monotonic() < self._no_room_until:
            return sample, ""
        if self._shared is None or self._shared.size < total or not self._still_named():
            self._drop_shared()
            size = max(SHARED_MIN_SIZE, 1 << (total - 1).bit_length())
            try:
                self._shared = shared_memory.SharedMemory(name=shm.object_name(), create=True, size=size)
                # its pages taken now: a full /dev/shm is an error here (and the pipe), never a
                # SIGBUS when a later copy touches a page there is no room for
                os.posix_fallocate(self._shared._fd, 0, size)
            except OSError as exc:
                log.warning("no room in /dev/shm for the sample hooks' %d MiB (%s): samples go through the "
                            "pipe", size >> 20, exc)
                self._drop_shared()
                self._no_room_until = time.monotonic() + NO_ROOM_RETRY_S
                return sample, ""
        buf, offset, out = self._shared.buf, 0, dict(sample)
        for k, v in large:
            buf[offset:offset + len(v)] = v
            out[k] = InShared(offset, len(v))
            offset += len(v)
        return out, self._shared.name

    def _still_named(self) -> bool:
        """Whether /dev/shm still holds our object under its name (someone may have cleaned it)."""
        try:
            return os.stat(os.path.join(shm.SHM_DIR, self._shared.name)).st_ino == os.fstat(self._shared._fd).st_ino
        except (OSError, AttributeError):
            return False

    def _drop_shared(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.close()
            try:
                shared.unlink()
            except FileNotFoundError:
                pass

    def apply(self, sample: dict, epoch: int) -> dict:
        """``sample`` after the hooks, for ``epoch``; SampleError (kind "filtered" or "parse_failed")
        when a hook skips it or fails on it."""
        key, url = sample.get("__key__", ""), sample.get("__url__", "")
        spec = HookSpec(self.spec.plugins, self.spec.seed, epoch, self.spec.limits)
        sent = sample if self._wanted is None else \
            {k: v for k, v in sample.items() if k.startswith("__") or k.rsplit(".", 1)[-1] in self._wanted}
        with self._lock:
            kind, value, costs = self._round_trip(spec, sent)
        costs = self._checked_costs(costs)
        if costs and self.on_costs is not None:
            self.on_costs(costs)
        if kind == "ok":
            changed, removed = value
            return {**{k: v for k, v in sample.items() if k not in removed}, **changed}
        if kind == "skip":
            raise SampleError(key, f"left out by a plugin: {value}", url, "filtered")
        raise SampleError(key, str(value), url, "plugin_failed")

    def _checked_costs(self, costs) -> HookCosts:
        """What the worker says its hooks spent, kept only where it is a cost of one of this job's
        sample hooks with finite, non-negative figures (the worker runs plugin code)."""
        names = {p.name for p in self.spec.plugins}
        if not isinstance(costs, dict):
            return {}
        return {key: cost for key, cost in list(costs.items())[:len(names)]
                if isinstance(key, tuple) and len(key) == 2 and key[0] in names and key[1] == "sample"
                and type(cost) is HookCost and isinstance(cost.cpu_s, float) and math.isfinite(cost.cpu_s)
                and cost.cpu_s >= 0 and type(cost.calls) is int and 0 <= cost.calls <= 1}

    def _round_trip(self, spec: HookSpec, sample: dict) -> tuple[str, object, HookCosts]:
        conn, process = self._started()
        try:
            conn.send((spec, *self._packed(sample)))
        except (BrokenPipeError, OSError):
            self._stop(kill=True)
            return "failed", "the plugin worker was gone; it is restarted", {}
        deadline = time.monotonic() + spec.limits.time_s + GRACE_S
        while True:
            try:
                if conn.poll(POLL_S):
                    reply = conn.recv()
                    break
            except (EOFError, OSError):
                process.join(timeout=5)
                code = process.exitcode
                self._stop(kill=True)
                return "failed", f"the plugin worker died (exit code {code}) on this sample", {}
            if not process.is_alive():
                continue  # its reply (if any) is read next, then EOF
            rss = procmem.resident_bytes([process.pid]) or 0
            over_memory = rss > self._baseline + spec.limits.memory_bytes
            if over_memory or time.monotonic() > deadline:
                self._stop(kill=True)
                if over_memory:
                    return "failed", (f"the sample hooks grew their worker to {rss >> 20} MiB, over the "
                                      f"{spec.limits.memory_bytes >> 20} MiB budget; killed"), {}
                return "failed", f"the sample hooks did not finish within {spec.limits.time_s + GRACE_S:g} s; killed", \
                    {}
        if reply[0] == "failed" and not process.is_alive():
            process.join(timeout=5)
            self._stop(kill=True)
        return reply[0], reply[1], reply[2]

    def _started(self):
        if self._process is not None and self._process.is_alive():
            return self._conn, self._process
        self._stop(kill=True)
        ctx = forkserver.context()
        parent, child = ctx.Pipe()
        process = ctx.Process(target=host_main, args=(child,), name="disttrain-plugins", daemon=True)
        process.start()
        child.close()
        if not parent.poll(START_TIMEOUT_S):
            process.kill()
            raise RuntimeError(f"the plugin worker did not start within {START_TIMEOUT_S:g} s")
        parent.recv()
        self._process, self._conn = process, parent
        self._baseline = procmem.resident_bytes([process.pid]) or 0
        self.starts += 1
        return parent, process

    def _stop(self, kill: bool = False) -> None:
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if conn is not None:
            try:
                if not kill:
                    conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            conn.close()
        if process is not None:
            if kill:
                process.kill()
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)

    def close(self) -> None:
        with self._lock:
            self._stop()
            self._drop_shared()
