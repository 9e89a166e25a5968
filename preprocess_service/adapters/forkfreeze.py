"""Imported last by the decode pool's fork server (decode.PRELOAD): moves every object the
preloaded modules made into the garbage collector's permanent generation (gc.freeze), so a
worker's collections never write to those pages and they stay shared with the fork server and the
other workers instead of being copied into each (CPython's advice for pre-fork servers)."""

import gc

gc.collect()
gc.freeze()
