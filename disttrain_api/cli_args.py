"""Command-line arguments of a job's fields, derived from JobConfig: the same names, defaults,
ranges and help text in every CLI (the service's ``run``, the trainer's ``train``).

Each field becomes ``--field-name`` (underscores to dashes); its default and help come from
JobConfig (config.field_defaults / field_help), so a CLI cannot drift from the service.
"""

from __future__ import annotations

import argparse
import typing

from disttrain_api.config import JobConfig, PluginConfig, field_defaults, field_help
from disttrain_api.errors import ConfigError

JOB_ARGUMENTS = ("seq_len", "dp_size", "num_microbatches", "seqs_per_microbatch", "seed", "num_epochs",
                 "shuffle_buffer", "shard_shuffle", "open_shards", "dedup", "manifests", "pack_window",
                 "reorder_algorithm", "stage_map",
                 "enc_shared_by", "gen_shared_by", "cost_feedback", "max_consecutive_errors", "max_error_fraction",
                 "tokenizer", "mix_by", "mix_epoch", "mix_epoch_samples", "plugins")
"""The scalar JobConfig fields a CLI offers (shards, image, audio, generation and cost are set otherwise)."""

ALIASES = {"reorder_algorithm": ("--reorder",), "stage_map": (), "shard_shuffle": ()}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_job_arguments(parser: argparse.ArgumentParser, fields: tuple[str, ...] = JOB_ARGUMENTS) -> None:
    """Adds one argument per JobConfig field in ``fields``, with JobConfig's default and help."""
    defaults, helps = field_defaults(JobConfig), field_help(JobConfig)
    hints = typing.get_type_hints(JobConfig)
    bounds = JobConfig.BOUNDS
    for name in fields:
        default, kind = defaults[name], hints[name]
        text = helps.get(name, name.replace("_", " "))
        if name in bounds:
            text += f" [{bounds[name][0]:g}, {bounds[name][1]:g}]"
        if kind is bool and default:
            parser.add_argument(_flag(f"no_{name}"), dest=name, action="store_false",
                                help=f"do not: {text[0].lower()}{text[1:]}")
        elif kind is bool:
            parser.add_argument(_flag(name), dest=name, action="store_true", help=text)
        elif name == "plugins":
            parser.add_argument("--plugin", dest=name, action="append", default=[], metavar="NAME[=JSON]",
                                help=f"{text} Give one --plugin NAME or NAME=JSON (its parameters) per plugin.")
        elif name == "stage_map":
            parser.add_argument(_flag(name), dest=name, default=",".join(default), metavar="STAGES",
                                help=f"{text} Comma-separated (default {','.join(default)}).")
        else:
            parser.add_argument(_flag(name), *ALIASES.get(name, ()), dest=name, type=kind, default=default,
                                help=f"{text} (default {default})")


def job_fields(args: argparse.Namespace, fields: tuple[str, ...] = JOB_ARGUMENTS) -> dict:
    """The JobConfig keyword arguments of parsed ``args`` (those ``add_job_arguments`` added)."""
    out = {name: getattr(args, name) for name in fields if hasattr(args, name)}
    if isinstance(out.get("stage_map"), str):
        out["stage_map"] = tuple(s.strip() for s in out["stage_map"].split(",") if s.strip())
    if isinstance(out.get("plugins"), list):
        out["plugins"] = tuple(_plugin(text) for text in out["plugins"])
    return out


def _plugin(text: str) -> PluginConfig:
    """``NAME`` or ``NAME=JSON`` -> a PluginConfig."""
    name, _, params = text.partition("=")
    if not name.strip():
        raise ConfigError(f"--plugin {text!r:.80}: give NAME or NAME=JSON")
    return PluginConfig(name=name.strip(), params=params or "{}")
