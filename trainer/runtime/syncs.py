"""Counting the host syncs a training step makes (``train.py --count-host-syncs``).

A host sync is a call that makes the host wait for the device: reading a tensor's value
(``item``, ``tolist``, ``int()``, ``float()``, ``bool()``, ``cpu``) or waiting for its queue
(``torch.cuda.synchronize``, an event's or a stream's ``synchronize``). On a CPU run these calls
cost nothing, but counting them there shows what a GPU run would pay, so the CPU tests bound the
GPU path: a step of the workers makes none, and the step's end one (reading the loss). Host
values are read with ``.numpy()`` instead, which fails on a device tensor rather than waiting.

Those are the calls from the counting thread, from Python. On a GPU the CUDA runtime's own view is
counted too (``torch.cuda.set_sync_debug_mode``: every synchronizing CUDA call, from C++ as well,
such as a boolean-mask index or a copy to a host tensor); a step's count is the larger of the two.
"""

from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager

import torch

SYNC_WARNING = "called a synchronizing CUDA operation"
"""What sync debug mode warns at each synchronizing call (not its notice that the mode is a
prototype, which the first switch to it also warns)."""
TENSOR_METHODS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "cpu")


class HostSyncCounter:
    """Patches the sync points while ``counting()`` is entered on this thread; ``calls`` lists them."""

    def __init__(self):
        self.calls: list[str] = []
        self.device_calls: list[str] = []
        """Synchronizing CUDA calls the runtime reported while counting (GPU only)."""
        self._thread = threading.get_ident()
        self._active = False
        self._saved: list[tuple[object, str, object]] = []

    def _wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)
        counter = self

        def counted(*args, **kwargs):
            if counter._active and threading.get_ident() == counter._thread:
                counter.calls.append(f"{getattr(owner, '__name__', owner)}.{name}")
            return original(*args, **kwargs)
        self._saved.append((owner, name, original))
        setattr(owner, name, counted)

    def install(self) -> HostSyncCounter:
        for name in TENSOR_METHODS:
            self._wrap(torch.Tensor, name)
        self._wrap(torch.cuda, "synchronize")
        self._wrap(torch.cuda.Event, "synchronize")
        self._wrap(torch.cuda.Stream, "synchronize")
        return self

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    @contextmanager
    def counting(self):
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self._active = True
        try:
            if not cuda:
                yield
                return
            previous = torch.cuda.get_sync_debug_mode()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    yield
                finally:
                    torch.cuda.set_sync_debug_mode(previous)
            self.device_calls += [f"{w.filename}:{w.lineno}: {str(w.message)[:200]}"  # where in Python
                                  for w in caught if SYNC_WARNING in str(w.message)]
        finally:
            self._active = False

    def take(self) -> list[str]:
        """The calls counted since the last take: the Python-level ones, or on a GPU the CUDA
        runtime's if it saw more."""
        calls, device, self.calls, self.device_calls = self.calls, self.device_calls, [], []
        return device if len(device) > len(calls) else calls
