"""Mixture files: a weighted mixture of datasets in YAML or JSON, as ``run --mix FILE`` and
``inspect --mix FILE`` read it, turned into JobConfig fields.

    mix_by: samples              # or tokens (optional)
    mix_epoch: first_exhausted   # or all_exhausted (optional)
    mix_epoch_samples: 0         # > 0: a fixed number of samples per epoch (optional)
    datasets:
      - name: laion
        shards: data/laion/{00000..00099}.tar     # a string or a list of them
        weight: 0.7
        image: {max_pixels: 200704}                # optional: ImageConfig fields for this dataset
        generate: none                             # optional: listed | all | none
      - name: speech
        shards: [data/speech/]
        weight: 0.3
        modalities: [text, audio]                  # optional: member kinds used

A bare list is read as the ``datasets``. Relative local shard paths are relative to the file's
folder (as Megatron-Energon's metadataset files). Bounded: at most MAX_MIX_FILE_BYTES.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from disttrain_api.config import DatasetConfig, ImageConfig
from disttrain_api.errors import ConfigError

MAX_MIX_FILE_BYTES = 1 << 20
_JOB_KEYS = ("mix_by", "mix_epoch", "mix_epoch_samples")
_DATASET_KEYS = ("name", "shards", "weight", "modalities", "image", "generate")


def load_mixture(path: str | Path) -> dict:
    """JobConfig keyword arguments (``datasets`` and any of mix_by, mix_epoch, mix_epoch_samples)
    from a mixture file; ConfigError naming the file and the problem."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_MIX_FILE_BYTES:
            raise ConfigError(f"mixture file {path}: {size} bytes, more than {MAX_MIX_FILE_BYTES}")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"mixture file {path}: cannot read it ({exc})") from None
    return parse_mixture(_load(text, path), base=path.parent, origin=str(path))


def _load(text: str, path: Path):
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"mixture file {path}: invalid JSON ({exc})") from None
    try:
        import yaml
    except ImportError:
        raise ConfigError(f"mixture file {path}: reading YAML needs PyYAML (pip install pyyaml), or write "
                          "the file as JSON") from None
    try:
        return yaml.safe_load(text)  # safe_load: no Python objects from a file
    except yaml.YAMLError as exc:
        raise ConfigError(f"mixture file {path}: invalid YAML ({exc})") from None


def parse_mixture(data, *, base: Path | None = None, origin: str = "mixture") -> dict:
    """JobConfig keyword arguments from the parsed content of a mixture file."""
    if isinstance(data, list):
        data = {"datasets": data}
    if not isinstance(data, dict) or not isinstance(data.get("datasets"), list) or not data["datasets"]:
        raise ConfigError(f"{origin}: expected a list of datasets, or a mapping with a non-empty 'datasets' list")
    unknown = set(data) - {"datasets", *_JOB_KEYS}
    if unknown:
        raise ConfigError(f"{origin}: unknown keys {sorted(unknown)} (known: datasets, {', '.join(_JOB_KEYS)})")
    out: dict = {key: data[key] for key in _JOB_KEYS if key in data}
    out["datasets"] = tuple(_dataset(entry, i, base, origin) for i, entry in enumerate(data["datasets"]))
    return out


def _dataset(entry, index: int, base: Path | None, origin: str) -> DatasetConfig:
    where = f"{origin}: dataset {index}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a mapping with name, shards and weight, got {type(entry).__name__}")
    unknown = set(entry) - set(_DATASET_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)} (known: {', '.join(_DATASET_KEYS)})")
    fields = dict(entry)
    shards = fields.get("shards")
    shards = [shards] if isinstance(shards, str) else shards
    if not isinstance(shards, list) or not all(isinstance(s, str) for s in shards):
        raise ConfigError(f"{where}: shards must be a string or a list of strings")
    fields["shards"] = tuple(_relative_to(s, base) for s in shards)
    if isinstance(fields.get("modalities"), list):
        fields["modalities"] = tuple(fields["modalities"])
    if "image" in fields:
        if not isinstance(fields["image"], dict):
            raise ConfigError(f"{where}: image must be a mapping of ImageConfig fields")
        try:
            fields["image"] = ImageConfig(**fields["image"])
        except TypeError as exc:
            raise ConfigError(f"{where}: image: {exc}") from None
    if isinstance(fields.get("weight"), int) and not isinstance(fields["weight"], bool):
        fields["weight"] = float(fields["weight"])
    try:
        return DatasetConfig(**fields)
    except TypeError as exc:  # a missing name or shards
        raise ConfigError(f"{where}: {exc}") from None


def _relative_to(spec: str, base: Path | None) -> str:
    """A relative local path is relative to the mixture file's folder; URLs and absolute paths stay."""
    if base is None or "://" in spec or ":" in spec.split("/", 1)[0] or os.path.isabs(spec):
        return spec
    return os.path.join(str(base), spec)
