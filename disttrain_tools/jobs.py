"""A job from the command line: the shard and mixture flags, --cost, and the embedded default
dataset (synthetic LAION-style shards) that ``run`` and ``inspect`` use when given none."""

from __future__ import annotations

import argparse
from pathlib import Path

from disttrain_api.cli_args import add_job_arguments, job_fields
from disttrain_api.config import JobConfig
from disttrain_api.errors import ConfigError

DEMO_DIR = Path("data/laion-demo")
DEMO_VIDEO_SHARE = 0.02
"""Phone videos in the embedded default (most turned by a display matrix). synth's own default
keeps none: the benches' committed figures were measured on corpora without them."""


def add_job_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shards", nargs="+", metavar="SPEC",
                        help="shard paths/URLs, brace patterns allowed (\"data/{00000..00009}.tar\"), or a "
                             f"directory of tars (default: a synthetic LAION-style set in {DEMO_DIR}/)")
    parser.add_argument("--mix", type=Path, metavar="FILE",
                        help="a weighted mixture of datasets instead of --shards: a YAML or JSON file of "
                             "datasets (name, shards, weight, optional modalities, image, generate) and "
                             "optionally mix_by, mix_epoch, mix_epoch_samples, which win over the flags "
                             "(see disttrain_api/mixture.py)")
    add_job_arguments(parser)
    parser.add_argument("--cost", type=Path, help="cost coefficients JSON, as `calibrate --out` writes")


def job_config_from_args(args) -> JobConfig:
    extra: dict = {}
    if getattr(args, "mix", None):
        from disttrain_api.mixture import load_mixture

        if args.shards:
            raise ConfigError("give --shards or --mix, not both")
        extra.update(load_mixture(args.mix))
        shard_specs: list[str] = []
    else:
        shard_specs = args.shards or [str(p) for p in ensure_demo_dataset()]
    if args.cost:
        from disttrain_tools import calibrate

        try:
            extra["cost"] = calibrate.load(args.cost)
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"--cost {args.cost}: {exc}") from None
    return JobConfig(shards=tuple(shard_specs), **{**job_fields(args), **extra})


def demo_config():
    """What the embedded default writes (synth.SynthConfig): synth's defaults, plus DEMO_VIDEO_SHARE
    phone videos."""
    from disttrain_tools import synth

    return synth.SynthConfig(video_share=DEMO_VIDEO_SHARE)


def ensure_demo_dataset(out_dir: Path = DEMO_DIR) -> list[Path]:
    """The embedded default: 4 synthetic LAION-style shards plus one with corrupt samples."""
    from disttrain_tools import synth

    with synth.dataset_lock(out_dir):
        marker = out_dir / synth.MARKER_NAME
        before = marker.read_text() if marker.exists() else None
        paths = synth._ensure_dataset(out_dir, demo_config())
        corrupt = out_dir / "corrupt.tar"
        if not corrupt.exists() or marker.read_text() != before:  # regenerated: the corrupt shard too
            synth.write_corrupt_shard(corrupt)
        return [*paths, corrupt]
