"""What a decode stage offers the service (streams.py, job.py): DecodePool and InlineDecoder both."""

from __future__ import annotations

import threading
from concurrent import futures
from typing import Protocol, runtime_checkable

from preprocess_service.adapters.plugins.hooks import HookSpec
from preprocess_service.core.assemble import Layout


@runtime_checkable
class Decoder(Protocol):
    def submit(self, layout: Layout, stop: threading.Event | None = None, hooks: HookSpec | None = None) \
            -> futures.Future:
        """Decodes ``layout``'s media into a buffer; the future gives a Decoded. ``stop`` names the
        stream (its microbatches are served fairly against other streams') and cancels its wait
        for memory. ``hooks``: the job's plugins, whose media hooks run on each decoded item."""
        ...

    def others_decoding(self, stop: threading.Event | None) -> bool:
        """Whether streams other than ``stop``'s have work waiting (a stream then decodes one
        microbatch ahead instead of two)."""
        ...

    def stats(self) -> dict:
        ...

    def close(self) -> None:
        ...
