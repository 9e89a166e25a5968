"""Imported last by the decode pool's fork server (forkserver.PRELOAD), in that process only:

- moves every object the preloaded modules made into the garbage collector's permanent generation
  (gc.freeze), so a worker's collections never write to those pages and they stay shared with the
  fork server and the other workers instead of being copied into each (CPython's advice for
  pre-fork servers);
- ends the fork server, once its pool closes, without tearing those modules down: it holds no
  files, buffers or children to flush (its workers exit on their own, through os._exit), and the
  teardown of torch and the decoders is CPU spent at every server shutdown for nothing.
"""

import atexit
import gc
import os

gc.collect()
gc.freeze()
gc.enable()  # forkgc turned it off for the imports
atexit.register(os._exit, 0)  # runs first (last registered): the rest of the exit is skipped
