"""``python -m disttrain_tools inspect SHARDS... | --mix FILE [job flags]``: what to check before a run.

Plans the job as the service would (shards expanded and checked, the job's tokenizer, samples
parsed and priced from headers, packed, costed, batch-planned and simulated; no pixel decoded)
for up to --max-samples samples of the first epoch, and prints samples read, accepted and skipped
by cause, samples per modality (and per dataset of a mixture), distributions of image resolution,
image tokens, text characters and tokens, audio seconds, documents and padding per sequence,
sequence cost per module, and the predicted straggler spread: per step the DP imbalance and the
simulated 1F1B iteration time in arrival order vs the job's planner vs the lower bound. Where a
shard has img2dataset's NNNNN.parquet, the downloaded resolution and caption length of ALL its
rows come from it (marked *), without reading the tar, and its failed-download rows are counted.
Writes the same as JSON (--json) and a PNG of histograms (--plot, needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from disttrain_api.cli_args import add_job_arguments
from disttrain_api.config import JobConfig
from disttrain_api.errors import ConfigError, DisttrainError
from disttrain_tools.datastats import (
    MODALITY_CLASSES,
    UNKNOWN,
    DocumentFacts,
    StepFacts,
    compute_stats,
    document_facts,
    series,
    step_facts,
)
from disttrain_tools.jobs import job_config_from_args
from preprocess_service.adapters.io.img2dataset import Manifest, read_manifest
from preprocess_service.adapters.media.conversations import TextPiece, parse_conversation
from preprocess_service.adapters.media.parse import CAPTION_MEMBER
from preprocess_service.core.planner import Documents, EpochPlanner
from preprocess_service.core.sample import Document, TextSegment

DEFAULT_MAX_SAMPLES = 5000
DEFAULT_PLOT = Path("inspect.png")


@dataclass(slots=True)
class Collected:
    """What planning the first epoch (up to max_samples) showed."""

    documents: list[DocumentFacts] = field(default_factory=list)
    steps: list[StepFacts] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)
    num_parsed: int = 0
    manifests: list[tuple[int, Manifest]] = field(default_factory=list)
    num_shards: int = 0
    seconds: float = 0.0


def collect(config: JobConfig, max_samples: int) -> Collected:
    """Plans ``config`` with the service's Job until ``max_samples`` documents are planned or the
    first epoch ends; keeps the numbers of each plan, never the media bytes."""
    from preprocess_service.service.job import Job

    start = time.perf_counter()
    job = Job(config)
    out = Collected(num_shards=len(job.shard_urls))
    out.manifests = [(i, m) for i, urls in enumerate(job.dataset_urls) for url in urls
                     if (m := read_manifest(url)) is not None]
    chars: dict[tuple[str, str], int] = {}
    documents, measured = job.documents, _measuring(job.documents.parse_only, chars, out)

    def parse(sample: dict) -> Document:
        doc = measured(sample)
        doc.media_bytes = None  # sizes are all inspect needs: drop the bytes at once
        return doc

    planner = EpochPlanner(config, job.dataset_urls,
                           Documents(documents, parse, documents.skipped, documents.fingerprint))
    while len(out.documents) < max_samples:
        plan = planner.next_plan()
        if plan is None or plan.epoch > 0:
            break
        out.documents.extend(document_facts(doc, chars.pop((doc.shard, doc.key), -1)) for doc in plan.documents())
        out.steps.append(step_facts(plan))
    out.skipped = Counter(record.kind for record in job.report()["skipped"])
    out.seconds = time.perf_counter() - start
    return out


def _measuring(parse: Callable[[dict], Document], chars: dict, out: Collected) -> Callable[[dict], Document]:
    """``parse``, also counting the documents it makes and their text characters."""
    def parse_and_measure(sample: dict) -> Document:
        doc = parse(sample)
        out.num_parsed += 1
        chars[(doc.shard, doc.key)] = text_chars(sample, doc)
        return doc

    return parse_and_measure


def text_chars(sample: dict, doc: Document) -> int:
    """Characters of ``doc``'s texts as ``sample`` holds them: its text members, its JSON caption or
    its conversation (role headers and turns, conversations.py); UNKNOWN if they cannot be measured.
    Never raises: a measurement is no reason to skip a sample the service accepted."""
    try:
        total, conversation = 0, False
        for seg in doc.segments:
            if not isinstance(seg, TextSegment):
                continue
            if seg.member == CAPTION_MEMBER:
                total += len(json.loads(sample["json"]).get("caption", ""))
            elif seg.member.startswith("json:"):  # a conversation's pseudo-members: no member of the sample
                conversation = True
            else:
                total += len(sample[seg.member].decode("utf-8", errors="replace"))
        if conversation:
            pieces = parse_conversation(json.loads(sample["json"])) or []
            total += sum(len(p.text) for p in pieces if isinstance(p, TextPiece))
        return total
    except Exception:  # whatever the sample holds, inspect goes on
        return UNKNOWN


# --- text --------------------------------------------------------------------------------------

ROWS = (
    ("sizes", None),
    ("image width, planned (px)", "image_width"),
    ("image height, planned (px)", "image_height"),
    ("image width, downloaded (px) *", "manifest_original_width"),
    ("image height, downloaded (px) *", "manifest_original_height"),
    ("image tokens per image", "image_tokens"),
    ("audio seconds per clip", "audio_seconds"),
    ("text characters per document", "text_chars"),
    ("caption characters *", "manifest_caption_chars"),
    ("text tokens per document", "text_tokens"),
    ("tokens per document", "document_tokens"),
    ("packed sequences", None),
    ("documents per sequence", "documents_per_sequence"),
    ("padding share per sequence", "padding_share"),
    ("encoder forward s per sequence", "encoder_s"),
    ("backbone forward s per sequence", "backbone_s"),
    ("generator forward s per sequence", "generator_s"),
    ("straggler spread, per step", None),
    ("DP imbalance, arrival order", "step_arrival_imbalance"),
    ("DP imbalance, {planner}", "step_imbalance"),
    ("1F1B iteration / bound, arrival", "step_arrival_over_bound"),
    ("1F1B iteration / bound, {planner}", "step_planned_over_bound"),
)
COLUMNS = ("count", "min", "p10", "p50", "p90", "p99", "max")


def render_text(stats: dict) -> str:
    """The report ``inspect`` prints, from ``compute_stats``'s dict (plus its "job" entry)."""
    job, samples = stats["job"], stats["samples"]
    planner = job["reorder_algorithm"]
    lines = [f"inspect: {job['what']}; seq_len {job['seq_len']}, {job['dp_size']} DP ranks x "
             f"{job['num_microbatches']} microbatches x {job['seqs_per_microbatch']} sequences, planner {planner}, "
             f"tokenizer {job['tokenizer']} ({stats['seconds']:.1f} s)"]
    skipped = ", ".join(f"{n} {kind}" for kind, n in samples["skipped_by_kind"].items())
    lines.append(f"samples   read {samples['read']}, accepted {samples['accepted']}, skipped {samples['skipped']}"
                 + (f" ({skipped})" if skipped else "")
                 + f"; {samples['planned']} planned in the {stats['steps']['count']} steps inspected"
                 + (" (first epoch, up to --max-samples)" if samples["planned"] < samples["accepted"] else ""))
    lines.append("modality  " + _modalities(stats["modalities"], samples["planned"])
                 + f"; {stats['num_generation_targets']} images to generate")
    lines.append("display   " + _orientations(stats["orientations"]))
    if len(stats["datasets"]) > 1:
        for d in stats["datasets"]:
            lines.append(f"  {d['name']:<12} {d['planned']:>6} planned: {_modalities(d['modalities'], d['planned'])}"
                         + (f"; parquet: {d['manifest_samples']} samples, {d['manifest_failed_rows']} failed rows"
                            if d["manifest_shards"] else "") + f"; {_orientations(d, short=True)}")
    m = stats["manifests"]
    lines.append(f"parquet   * img2dataset manifests of {m['shards']} of {m['of_shards']} shards: {m['samples']} "
                 f"samples, {m['failed_rows']} failed-download rows (all rows, tars not read)" if m["shards"] else
                 "parquet   no img2dataset manifest beside the shards (no * rows)")
    lines.append("")
    lines.append(f"{'':<36}" + "".join(f"{c:>10}" for c in COLUMNS))
    for label, name in ROWS:
        if name is None:
            lines.append(label)
            continue
        dist = stats["distributions"][name]
        if dist["count"]:
            lines.append(f"  {label.format(planner=planner):<34}" + "".join(f"{_fmt(dist[c]):>10}" for c in COLUMNS))
    lines.append(_totals(stats["steps"], planner))
    return "\n".join(lines)


def _orientations(counts: dict, short: bool = False) -> str:
    """Samples shown turned or mirrored (EXIF orientation, a video's display matrix) and manifest
    sizes the bytes overruled: what a viewer shows differs from the stored pixels there."""
    images, videos, mismatches = (counts["samples_oriented_images"], counts["samples_oriented_videos"],
                                  counts["declared_size_mismatches"])
    if short:
        return f"turned or mirrored: {images} with images, {videos} with videos; manifest sizes overruled: {mismatches}"
    return (f"{images} samples with images turned or mirrored by their EXIF orientation, {videos} with videos "
            f"rotated or mirrored by their display matrix (delivered as a viewer shows them); {mismatches} "
            "manifest sizes disagree with their images' bytes (the bytes' used)")


def _modalities(counts: dict, total: int) -> str:
    return ", ".join(f"{name} {counts[name]} ({100 * counts[name] / max(1, total):.0f}%)"
                     for name in MODALITY_CLASSES if counts[name])


def _fmt(value) -> str:
    return str(value) if isinstance(value, int) else f"{value:.4g}"


def _totals(steps: dict, planner: str) -> str:
    if not steps["count"]:
        return "no step planned"
    arrival, planned = steps["total_arrival_iteration_s"], steps["total_iteration_s"]
    bound = steps["total_lower_bound_s"]
    return (f"predicted time of the {steps['count']} steps (simulated 1F1B, cost-model s): "
            f"arrival order {arrival:.3f}, {planner} {planned:.3f} ({100 * (planned / arrival - 1):+.1f}%), "
            f"lower bound {bound:.3f} ({planner} {100 * (planned / bound - 1):+.1f}% above it)")


# --- command -----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m disttrain_tools inspect", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shards", nargs="*", metavar="SHARDS",
                        help="shard paths/URLs, brace patterns (\"data/{00000..00009}.tar\") or directories of tars")
    parser.add_argument("--mix", type=Path, metavar="FILE", help="a mixture file (YAML or JSON) instead of SHARDS")
    add_job_arguments(parser)
    parser.add_argument("--cost", type=Path, help="cost coefficients JSON, as `calibrate --out` writes")
    parser.add_argument("--max-samples", type=int, default=DEFAULT_MAX_SAMPLES, metavar="N",
                        help=f"plan at most about N samples of the first epoch (default {DEFAULT_MAX_SAMPLES})")
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                        help=f"where the histograms go (default {DEFAULT_PLOT}; needs matplotlib: "
                             "pip install 'disttrain[inspect]')")
    parser.add_argument("--no-plot", action="store_true", help="no PNG")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the statistics as JSON here")
    return parser


def inspect(config: JobConfig, max_samples: int) -> tuple[dict, dict]:
    """(statistics as compute_stats gives them plus "job" and "seconds", the value arrays to plot)."""
    got = collect(config, max_samples)
    names = [d.name for d in config.mixture()]
    stats = compute_stats(got.documents, got.steps, dataset_names=names, skipped=got.skipped,
                          num_parsed=got.num_parsed, manifests=got.manifests, num_shards=got.num_shards)
    what = f"{len(names)} datasets" if config.datasets else f"{got.num_shards} shards"
    stats["job"] = {"what": what, **{k: getattr(config, k) for k in (
        "seq_len", "dp_size", "num_microbatches", "seqs_per_microbatch", "reorder_algorithm", "tokenizer")}}
    stats["seconds"] = got.seconds
    return stats, series(got.documents, got.steps, (m for _, m in got.manifests))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if bool(args.shards) == bool(args.mix):
            raise ConfigError("give SHARDS or --mix FILE (one of them)")
        if args.max_samples < 1:
            raise ConfigError(f"--max-samples must be at least 1, got {args.max_samples}")
        stats, values = inspect(job_config_from_args(args), args.max_samples)
    except DisttrainError as exc:  # ConfigError, PermissionDenied, DataQualityError: the user's to fix
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(render_text(stats))
    if args.json:
        args.json.write_text(json.dumps(stats, indent=1))
        print(f"statistics written to {args.json}")
    if not args.no_plot:
        from disttrain_tools.inspect_plot import PlotUnavailable, render_png

        try:
            render_png(values, stats, args.plot or DEFAULT_PLOT)
            print(f"plot written to {args.plot or DEFAULT_PLOT}")
        except PlotUnavailable as exc:
            print(f"{'error' if args.plot else 'no plot'}: {exc}", file=sys.stderr)
            return 2 if args.plot else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
