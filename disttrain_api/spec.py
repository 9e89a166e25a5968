"""Conversions between the protobuf JobSpec and the typed JobConfig (zero means default)."""

from __future__ import annotations

import dataclasses

from disttrain_api import preprocess_pb2 as pb
from disttrain_api.config import AudioConfig, CostConfig, GenerationConfig, ImageConfig, JobConfig

# Scalar fields with the same name in JobSpec and JobConfig. The boolean no_shard_shuffle is negated
# by hand so that proto3's default false means our default (shuffle).
_JOB_FIELDS = ("seq_len", "dp_size", "num_microbatches", "seqs_per_microbatch", "seed", "num_epochs",
               "shuffle_buffer", "reorder_algorithm", "pack_window", "enc_shared_by", "gen_shared_by",
               "cost_feedback", "max_consecutive_errors", "max_error_fraction")


def _nonzero_fields(message, names) -> dict:
    return {name: getattr(message, name) for name in names if getattr(message, name)}


def config_from_spec(spec: pb.JobSpec) -> JobConfig:
    """Fills defaults for zero fields; raises ConfigError on invalid values."""
    image = ImageConfig(**_nonzero_fields(spec.image, [f.name for f in dataclasses.fields(ImageConfig)]))
    cost_names = [f.name for f in dataclasses.fields(CostConfig)]
    cost = CostConfig(**_nonzero_fields(spec.cost, cost_names))
    audio = AudioConfig(**_nonzero_fields(spec.audio, [f.name for f in dataclasses.fields(AudioConfig)]))
    generation = GenerationConfig(**_nonzero_fields(spec.generation,
                                                    [f.name for f in dataclasses.fields(GenerationConfig)]))
    extra = {"stage_map": tuple(spec.stage_map)} if spec.stage_map else {}
    return JobConfig(shards=tuple(spec.shards), shard_shuffle=not spec.no_shard_shuffle,
                     image=image, audio=audio, generation=generation, cost=cost, **extra,
                     **_nonzero_fields(spec, _JOB_FIELDS))


def spec_from_config(config: JobConfig) -> pb.JobSpec:
    """The fully specified proto form of a config."""
    return pb.JobSpec(
        shards=list(config.shards),
        stage_map=list(config.stage_map),
        no_shard_shuffle=not config.shard_shuffle,
        image=pb.ImageSpec(**dataclasses.asdict(config.image)),
        audio=pb.AudioSpec(**dataclasses.asdict(config.audio)),
        generation=pb.GenerationSpec(**dataclasses.asdict(config.generation)),
        cost=pb.CostSpec(**dataclasses.asdict(config.cost)),
        **{name: getattr(config, name) for name in _JOB_FIELDS},
    )
