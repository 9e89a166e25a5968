"""InlineDecoder: the decode stage in the calling process, on a thread pool (tests, debugging,
``--decode-workers 0``)."""

from __future__ import annotations

import threading
from concurrent import futures

import numpy as np

from preprocess_service.adapters.decode.items import Decoded, decode_into, missing_reason
from preprocess_service.adapters.infra.budget import UNLIMITED, MemoryBudget, call_once
from preprocess_service.adapters.plugins.hooks import HookSpec, MediaHooks, PluginFailed
from preprocess_service.core.assemble import Layout


class InlineDecoder:
    """Decodes in this process on ``num_threads`` threads (the decoders release the GIL)."""

    def __init__(self, num_threads: int = 1, budget: MemoryBudget = UNLIMITED):
        self._threads = futures.ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="decode")
        self.budget = budget

    @staticmethod
    def others_decoding(stop: threading.Event | None) -> bool:
        """Never: submit decodes before it returns (DecodePool.others_decoding)."""
        return False

    def submit(self, layout: Layout, stop: threading.Event | None = None, hooks: HookSpec | None = None) \
            -> futures.Future:
        self.budget.reserve(layout.nbytes, what="a microbatch's decode buffer", stop=stop)
        try:
            buffer = np.zeros(layout.nbytes, dtype=np.uint8)
            media_hooks = MediaHooks(hooks) if hooks is not None else None
            errors = dict(self._threads.map(lambda pair: self._decode_document(buffer, *pair, media_hooks),
                                            layout.documents))
        except BaseException:
            self.budget.release(layout.nbytes)
            raise
        done = futures.Future()
        done.set_result(Decoded(buffer, {key: e for key, e in errors.items() if e},
                                call_once(lambda: self.budget.release(layout.nbytes)),
                                hook_costs=media_hooks.take_costs() if media_hooks is not None else {}))
        return done

    @staticmethod
    def _decode_document(buffer, doc, items, hooks=None) -> tuple[str, str | None]:
        problem = missing_reason(doc)
        if problem:
            return doc.key, problem
        try:
            for item in items:
                decode_into(buffer, item, doc.media_bytes[item.member], 0, hooks, doc.key)
        except (MemoryError, ImportError):
            raise
        except PluginFailed as exc:
            return doc.key, str(exc)
        except Exception as exc:  # any decoder failure means this sample is unusable
            return doc.key, f"{type(exc).__name__}: {exc}"
        return doc.key, None

    def stats(self) -> dict:
        return {"workers": 0}

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
