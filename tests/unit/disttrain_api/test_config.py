"""One config source: JobConfig defines a job's fields; the proto, the spec conversion, every CLI
and the settings file are derived from it or checked here against it."""

import dataclasses
import typing

import pytest
from google.protobuf.descriptor import FieldDescriptor

from disttrain_api import preprocess_pb2 as pb
from disttrain_api.cli_args import JOB_ARGUMENTS, add_job_arguments, job_fields
from disttrain_api.config import CostConfig, JobConfig, field_defaults, field_help
from disttrain_api.errors import ConfigError
from disttrain_api.spec import BY_HAND, NESTED, config_from_spec, spec_from_config
from disttrain_tools import cli, reorder_cli
from preprocess_service.service import settings
from trainer import train

_PROTO_KINDS = {int: {FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_INT32,
                      FieldDescriptor.TYPE_INT64},
                float: {FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT},
                bool: {FieldDescriptor.TYPE_BOOL}, str: {FieldDescriptor.TYPE_STRING}}


@pytest.mark.parametrize("cls, message", [(JobConfig, pb.JobSpec), *NESTED.values()],
                         ids=lambda x: getattr(x, "__name__", ""))
def test_every_config_field_has_its_proto_field_and_back(cls, message):
    hints = typing.get_type_hints(cls)
    proto = message.DESCRIPTOR.fields_by_name
    mapped = {"shard_shuffle": "no_shard_shuffle"}
    for f in dataclasses.fields(cls):
        name = mapped.get(f.name, f.name)
        assert name in proto, f"{cls.__name__}.{f.name} has no field in {message.__name__}"
        kind = hints[f.name]
        if f.name in NESTED:
            assert proto[name].message_type.name == NESTED[f.name][1].DESCRIPTOR.name
        elif typing.get_origin(kind) is tuple:
            assert proto[name].is_repeated if hasattr(proto[name], "is_repeated") else proto[name].label == 3
        else:
            assert proto[name].type in _PROTO_KINDS[kind], f"{f.name}: {kind} vs proto type {proto[name].type}"
    fields = {mapped.get(f.name, f.name) for f in dataclasses.fields(cls)}
    assert set(proto) <= fields, f"{message.__name__} fields JobConfig does not define: {set(proto) - fields}"


def test_zero_is_kept_where_zero_is_meaningful_and_unset_means_default():
    fitted = CostConfig(enc_quadratic_s=0.0, bb_quadratic_s=0.0, gen_per_image_s=0.0, gen_backward_factor=0.0)
    config = JobConfig(shards=("a.tar",), cost=fitted, seed=7, shard_shuffle=False, stage_map=("enc", "bb/2", "bb/2"))
    back = config_from_spec(pb.JobSpec.FromString(spec_from_config(config).SerializeToString()))
    assert back == config and back.cost.bb_quadratic_s == 0.0
    every_cost_field = [f.name for f in dataclasses.fields(CostConfig)]
    assert all(pb.CostSpec.DESCRIPTOR.fields_by_name[n].has_presence for n in every_cost_field)
    assert config_from_spec(pb.JobSpec(shards=["a.tar"])) == JobConfig(shards=("a.tar",))
    partial = config_from_spec(pb.JobSpec(shards=["a.tar"], cost=pb.CostSpec(bb_linear_s=0.0)))
    assert partial.cost == dataclasses.replace(CostConfig(), bb_linear_s=0.0)
    assert set(BY_HAND) <= {f.name for f in dataclasses.fields(JobConfig)}


def test_every_cli_offers_the_job_fields_with_the_service_defaults_and_help():
    defaults, helps = field_defaults(JobConfig), field_help(JobConfig)
    run_args, _ = cli.build_parser().parse_known_args(["run"])
    got = job_fields(run_args)
    assert set(got) == set(JOB_ARGUMENTS)
    expected = {name: defaults[name] for name in JOB_ARGUMENTS}
    assert got == expected, "python -m disttrain_tools run defaults differ from JobConfig's"
    trainer_args = train.parse(["--address", "x:1", "--shards", "s.tar"])
    assert job_fields(trainer_args, train.TRAINER_JOB_ARGUMENTS) == \
        {name: defaults[name] for name in train.TRAINER_JOB_ARGUMENTS}, "the trainer's defaults differ"
    assert train.job_config(trainer_args).reorder_algorithm == JobConfig(shards=("s",)).reorder_algorithm
    parser = cli.build_parser()
    run = parser._subparsers._group_actions[0].choices["run"]
    for action in run._actions:
        if action.dest in JOB_ARGUMENTS and action.dest in helps:
            assert helps[action.dest].rstrip(".").lower() in action.help.lower(), action.dest
    assert reorder_cli.build_parser().parse_args(["plan", "i.json", "-o", "o.json"]).algorithm == \
        defaults["reorder_algorithm"], "the batch-planning CLI defaults to the service's planner"


def test_cli_job_arguments_parse_into_a_config():
    import argparse

    parser = argparse.ArgumentParser()
    add_job_arguments(parser)
    args = parser.parse_args(["--seq-len", "4096", "--no-shard-shuffle", "--cost-feedback", "--reorder", "lpt",
                              "--stage-map", "enc,bb/2,bb/2,gen", "--max-error-fraction", "0.25"])
    config = JobConfig(shards=("a",), **job_fields(args))
    assert (config.seq_len, config.shard_shuffle, config.cost_feedback, config.reorder_algorithm) == \
        (4096, False, True, "lpt")
    assert config.stage_map == ("enc", "bb/2", "bb/2", "gen") and config.max_error_fraction == 0.25


def test_settings_parse_bools_from_toml_environment_and_flags(tmp_path):
    assert settings.load(environ={}).warm_up is True
    for text, want in [("false", False), ("0", False), ("OFF", False), ("yes", True), ("1", True)]:
        assert settings.load(environ={"DISTTRAIN_WARM_UP": text}).warm_up is want, text
    toml = tmp_path / "s.toml"
    toml.write_text("warm_up = false\n")
    assert settings.load(toml, environ={}).warm_up is False
    assert settings.load(environ={}, overrides={"warm_up": "no"}).warm_up is False
    with pytest.raises(ConfigError, match="warm_up = 'maybe' is not a valid bool"):
        settings.load(environ={"DISTTRAIN_WARM_UP": "maybe"})
    toml.write_text('warm_up = "false"\n')  # a string in TOML: read as the word, not as a truthy string
    assert settings.load(toml, environ={}).warm_up is False
