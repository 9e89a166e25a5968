"""Imported first by the decode pool's fork server (forkserver.PRELOAD), in that process only:
turns the cyclic garbage collector off while the preloaded modules import. Importing torch makes
hundreds of thousands of long-lived objects, and every collection during it only walks them
again, on the path to a service's first microbatch.
forkfreeze, imported last, collects once, freezes what remains and turns the collector back on."""

import gc

gc.disable()
