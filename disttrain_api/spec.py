"""Conversions between the protobuf JobSpec and the typed JobConfig.

JobConfig is the definition of a job's fields; the proto mirrors it and this module maps them by
name (tests/unit/disttrain_api/test_config.py fails on any drift). A proto field with presence (proto3 ``optional``)
is taken when set, whatever its value, so a fitted cost coefficient of 0 stays 0; a field without
presence means "the default" when it is zero. Two fields are mapped by hand: ``no_shard_shuffle``
is the negation of ``shard_shuffle`` (so proto3's false means our default, shuffling), and the
repeated fields ``shards``, ``stage_map``, ``datasets`` and ``plugins``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from disttrain_api import preprocess_pb2 as pb
from disttrain_api.config import (
    MODALITIES,
    AudioConfig,
    CostConfig,
    DatasetConfig,
    GenerationConfig,
    ImageConfig,
    JobConfig,
    PluginConfig,
    VideoConfig,
)

NESTED = {"image": (ImageConfig, pb.ImageSpec), "audio": (AudioConfig, pb.AudioSpec),
          "generation": (GenerationConfig, pb.GenerationSpec), "cost": (CostConfig, pb.CostSpec),
          "video": (VideoConfig, pb.VideoSpec)}
"""JobConfig's nested configs and their messages: the same field names inside."""
BY_HAND = ("shards", "stage_map", "shard_shuffle", "datasets", "plugins")

_JOB_FIELDS = tuple(f.name for f in dataclasses.fields(JobConfig) if f.name not in NESTED and f.name not in BY_HAND)
"""Scalar fields with the same name in JobSpec and JobConfig."""


def _given(message, names) -> dict:
    """The fields of ``message`` that carry a value: set ones with presence, non-zero ones without."""
    out = {}
    for name in names:
        descriptor = message.DESCRIPTOR.fields_by_name[name]
        if descriptor.has_presence:
            if message.HasField(name):
                out[name] = getattr(message, name)
        elif getattr(message, name):
            out[name] = getattr(message, name)
    return out


def _names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def config_from_spec(spec: pb.JobSpec) -> JobConfig:
    """Fills defaults for fields not given; raises ConfigError on invalid values."""
    nested = {name: cls(**_given(getattr(spec, name), _names(cls))) for name, (cls, _) in NESTED.items()}
    extra: dict[str, Any] = {"stage_map": tuple(spec.stage_map)} if spec.stage_map else {}
    return JobConfig(shards=tuple(spec.shards), shard_shuffle=not spec.no_shard_shuffle, **nested, **extra,
                     datasets=tuple(_dataset_config(d) for d in spec.datasets),
                     plugins=tuple(PluginConfig(name=p.name, params=p.params_json or "{}") for p in spec.plugins),
                     **_given(spec, _JOB_FIELDS))


def _dataset_config(spec: pb.DatasetSpec) -> DatasetConfig:
    return DatasetConfig(name=spec.name, shards=tuple(spec.shards), weight=spec.weight or 1.0,
                         modalities=tuple(spec.modalities) or MODALITIES, generate=spec.generate,
                         image=ImageConfig(**_given(spec.image, _names(ImageConfig))) if spec.HasField("image")
                         else None)


def _dataset_spec(config: DatasetConfig) -> pb.DatasetSpec:
    image = pb.ImageSpec(**dataclasses.asdict(config.image)) if config.image is not None else None
    return pb.DatasetSpec(name=config.name, shards=list(config.shards), weight=config.weight,
                          modalities=list(config.modalities), image=image, generate=config.generate)


def spec_from_config(config: JobConfig) -> pb.JobSpec:
    """The fully specified proto form of a config."""
    return pb.JobSpec(
        shards=list(config.shards),
        stage_map=list(config.stage_map),
        no_shard_shuffle=not config.shard_shuffle,
        datasets=[_dataset_spec(d) for d in config.datasets],
        plugins=[pb.PluginSpec(name=p.name, params_json=p.params_json) for p in config.plugins],
        **{name: message(**dataclasses.asdict(getattr(config, name))) for name, (_, message) in NESTED.items()},
        **{name: getattr(config, name) for name in _JOB_FIELDS},
    )
