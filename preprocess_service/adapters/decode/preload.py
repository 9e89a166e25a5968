"""What the decode pool's fork server imports before it forks workers (forkserver.PRELOAD names
this module alone), in that process only:

- the cyclic garbage collector is off while torch and the decoders import: importing torch makes
  hundreds of thousands of long-lived objects, and every collection during it only walks them again;
- then everything imported moves into the collector's permanent generation (gc.freeze), so a
  worker's collections never write to those pages and they stay shared with the fork server and
  the other workers (CPython's advice for pre-fork servers);
- the fork server, once its pool closes, ends without tearing those modules down (its workers exit
  through os._exit; it holds no files, buffers or children to flush).

Imports only, nothing that starts a thread pool (a fork would copy it half-made); each worker warms
its decoders itself. A decoder that is not installed is skipped, as the fork server would skip it."""

import atexit
import gc
import importlib
import os

MODULES = ("numpy", "torch", "soundfile", "simplejpeg", "PIL.Image",
           "av", "preprocess_service.adapters.media.imaging", "preprocess_service.adapters.media.audio",
           "preprocess_service.adapters.media.video",
           "preprocess_service.adapters.decode.items", "preprocess_service.adapters.decode.worker")

gc.disable()
try:
    for _name in MODULES:
        try:
            importlib.import_module(_name)
        except ImportError:
            pass
finally:
    gc.collect()
    gc.freeze()
    gc.enable()
atexit.register(os._exit, 0)  # runs first (last registered): the rest of the exit is skipped
