"""The decode stage: fills a microbatch's output buffer (assemble.Layout) with decoded media.

Two implementations of one interface, ``submit(layout) -> Future[Decoded]``:

- ``DecodePool`` (the service default): one worker process per core, forked from a fork server
  that imported torch and the decoders once (so a worker starts in milliseconds and shares those
  pages with its siblings, where spawning each would import torch again, in CPU and memory per
  worker). Workers start in the background; work waits for a ready one, and
  ``wait_ready()`` blocks until all are up. Encoded bytes go into a
  shared-memory arena beside the microbatch's output slots; a task (one document) is a few
  numbers through a pipe, and the worker writes its arrays straight into their slots, so nothing
  large is pickled and the output does not depend on which worker finishes first. Each worker
  holds at most ``max_in_flight`` tasks; the rest wait in the pool, and a stream submits at most
  two microbatches ahead, so memory is bounded. Waiting work is served fairly across streams
  (fairqueue.py): each waiting stream gets one microbatch decoded per round, whatever it
  queued. A worker that dies is replaced at once and its in-flight documents are retried once
  (ahead of later work) on another worker; a document that kills a worker twice is reported
  as failed (``DecodeError.worker_died``), never lost and never delivered twice.
- ``InlineDecoder``: the same decoding in the calling process on a thread pool (tests, debugging,
  ``--decode-workers 0``).

The package: ``items`` (one item into its slot; Decoded, Lent), ``inline`` (InlineDecoder),
``worker`` (a worker process's loop), ``pool`` (DecodePool: dispatch, supervision), ``arenas``
(shared-memory arenas: acquire, release, lend, reclaim), ``fairqueue``, ``shm`` (same-host delivery),
``forkserver`` and ``preload`` (the workers' fork server),
``protocol`` (Decoder: what the service calls, typed).
"""

from preprocess_service.adapters.decode.inline import InlineDecoder
from preprocess_service.adapters.decode.items import Decoded, Lent, decode_item, warm_up_decoders
from preprocess_service.adapters.decode.pool import MAX_START_FAILURES, WORKER_DIED, DecodePool
from preprocess_service.adapters.decode.protocol import Decoder

__all__ = ["MAX_START_FAILURES", "WORKER_DIED", "DecodePool", "Decoded", "Decoder", "InlineDecoder", "Lent",
           "decode_item", "warm_up_decoders"]
