"""Media modalities as records: what a kind of media is in a microbatch. Layout (core/assemble.py)
loops over the registered records to place placeholders, fill the modality array, size each
item's output slot and region, and emit the span and metadata arrays; pricing (core/packing.py,
core/feedback.py) reads which module each kind costs (``priced_by``); the decode stage looks a
kind's decoder up by the same name (adapters/decode/items.py, DECODERS).

One file per modality, each registering its record (every module here whose name does not start
with an underscore is imported below): ``image.py`` (encoder images), ``audio.py`` (log-mel clips),
``gen.py`` (generation targets). Their codes order their regions in a microbatch's output buffer
and their arrays on the wire."""

from __future__ import annotations

import importlib
import pkgutil

from preprocess_service.core.modalities._record import (
    MODALITIES,
    MODALITY_OF_SEGMENT,
    Modality,
    encoder_tokens,
    num_generated,
    register,
)

__all__ = ["MODALITIES", "MODALITY_OF_SEGMENT", "Modality", "encoder_tokens", "num_generated", "register"]

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
