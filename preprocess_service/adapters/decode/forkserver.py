"""The decode pool's fork server (decode/pool.py), startable before anything heavy is imported.

The fork server imports torch and the decoders once, and the pool's workers fork from it. It is
the longest step before a service's first microbatch, so a process that will
serve (``serve``, ``run``, an embedded service) calls ``start()`` first thing: the fork server's
imports then overlap the process's own (gRPC, numpy, the planner's JIT kernels) instead of
following them. This module imports nothing but multiprocessing, so calling it costs nothing.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing import forkserver

PRELOAD = ("preprocess_service.adapters.decode.preload",)
"""What the fork server imports before it forks workers: one module, which imports torch and the
decoders with the garbage collector off and freezes what they made (preload.py)."""


def context():
    """The multiprocessing context the pool's workers start from (one fork server per process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the fork server starts (once per process)
    return ctx


def start() -> None:
    """Launches the fork server now, without waiting for its imports; a DecodePool made later in
    this process uses it. Idempotent; a process that never makes a pool leaves it idle (it ends
    with the process)."""
    context()
    forkserver.ensure_running()
