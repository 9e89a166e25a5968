"""Shard formats: how the samples of a shard file are laid out, one module per format, each
registered by the file-name suffixes it reads. Adding a format is adding a file here (every module
whose name does not start with an underscore is imported below) with a ``Format`` subclass
decorated ``@register``. A format turns its file into webdataset-style raw samples (``__key__``,
``__url__``, member name -> bytes), so every later step (parsing, pricing, decoding, the report)
is the same for every format.

* WebDataset tars are the default (shards.py and tarstream.py read them: any name not claimed
  here, so ``.tar``, ``.tar.gz``, ``pipe:`` commands ...);
* ``parquet.py``: Parquet files of the Hugging Face datasets layout (``.parquet``);
* ``llava.py``: LLaVA-style instruction data, one JSON or JSON Lines file of records whose images
  are files beside it (``.json``, ``.jsonl``).
"""

from __future__ import annotations

import importlib
import pkgutil

from preprocess_service.adapters.io.formats._base import FORMATS, Format, format_of, register, suffixes

__all__ = ["FORMATS", "Format", "format_of", "register", "suffixes"]

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
