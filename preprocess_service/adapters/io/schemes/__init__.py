"""Shard schemes: how a shard of each scheme is opened and read by key, one class per file,
registered by the scheme names it serves. Adding a scheme is adding a file here (every module
whose name does not start with an underscore is imported below) with a ``Scheme`` subclass
decorated ``@register``; the operator still has to allow it (allowed_shard_schemes), and its
names follow the naming rule it declares (sources.parse).

* ``local.py``: ``file`` (local paths);
* ``http.py``: ``http``, ``https`` (downloaded into the shard cache, Range resumes);
* ``object_store.py``: ``s3``, ``gs`` (fsspec, the server's credentials; the [remote] extra);
* ``program.py``: schemes webdataset's gopen serves by running a program (``pipe`` ...), and any
  other scheme an operator allows (the fallback).
"""

from __future__ import annotations

import importlib
import pkgutil

from preprocess_service.adapters.io.schemes._base import SCHEMES, Scheme, register, scheme_of

__all__ = ["SCHEMES", "Scheme", "register", "scheme_of"]

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
