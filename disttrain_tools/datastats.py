"""Statistics of a job's data as its planner sees it, for ``python -m disttrain_tools inspect``.

Three steps, all pure: ``document_facts`` / ``step_facts`` keep the numbers of each planned
document and step (no bytes); ``series`` turns them, with img2dataset manifests when there are
some, into named arrays (what the plot draws); ``compute_stats`` summarises those into a
JSON-serialisable dict (what the text and ``--json`` show).

A document's modality is one of MODALITY_CLASSES, the first that applies: ``generation`` (it has
an image to generate), ``conversation`` (text it only reads: a conversation's role headers and
user turns; its pieces are separate texts but it is not interleaved data), ``interleaved`` (two or
more texts), ``audio`` (an audio clip), ``image-text`` (an encoder image), ``text-only``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from preprocess_service.core.planner import StepPlan
from preprocess_service.core.sample import Document, TextSegment, VideoRef

MODALITY_CLASSES = ("image-text", "audio", "video", "interleaved", "conversation", "text-only", "generation")
PERCENTILES = (10, 50, 90, 99)
UNKNOWN = -1
"""A number the source does not give (a manifest's missing size, a text not measured)."""


@dataclass(frozen=True, slots=True)
class DocumentFacts:
    """The numbers of one planned document."""

    dataset: int
    modality: str
    image_sizes: tuple[tuple[int, int], ...]
    """(height, width) of each encoder image as planned (resized), pixels."""
    image_tokens: tuple[int, ...]
    audio_seconds: tuple[float, ...]
    num_generated: int
    text_tokens: int
    text_chars: int
    """Characters of its texts as the sample holds them; UNKNOWN when not measured."""
    num_tokens: int
    num_oriented_images: int = 0
    """Its images (generation targets included) whose EXIF orientation turns or mirrors them."""
    num_oriented_videos: int = 0
    """Its videos whose display matrix (or rotate tag) turns or mirrors them."""
    num_declared_size_mismatches: int = 0
    """Its images whose manifest size disagreed with their header (the header's was used)."""


@dataclass(frozen=True, slots=True)
class StepFacts:
    """The numbers of one step plan: its sequences' sizes and costs, balance and simulation."""

    step: int
    num_padding_sequences: int
    """Empty sequences that fill a short last batch."""
    documents_per_sequence: tuple[int, ...]
    padding_share: tuple[float, ...]
    """Per non-empty sequence: free tokens / seq_len."""
    module_s: tuple[tuple[float, float, float], ...]
    """Per non-empty sequence: (encoder, backbone, generator) forward seconds of the cost model."""
    imbalance: float
    """Max/mean rank load with the job's planner."""
    arrival_imbalance: float
    iteration_s: float
    """Simulated 1F1B iteration time of the plan, cost-model seconds."""
    arrival_iteration_s: float
    lower_bound_s: float


class ManifestLike(Protocol):
    """What img2dataset's parquet says about a shard (adapters/img2dataset.Manifest)."""

    width: np.ndarray
    height: np.ndarray
    original_width: np.ndarray
    original_height: np.ndarray
    caption_chars: np.ndarray
    num_failed: int
    """Its failed-download rows, all of them."""

    @property
    def num_samples(self) -> int: ...


def modality_of(doc: Document) -> str:
    if doc.generated:
        return "generation"
    if any(isinstance(s, TextSegment) and not s.trainable for s in doc.segments):
        return "conversation"
    if sum(1 for s in doc.segments if isinstance(s, TextSegment)) >= 2:
        return "interleaved"
    if doc.audio:
        return "audio"
    if any(isinstance(s, VideoRef) for s in doc.segments):
        return "video"
    return "image-text" if doc.images else "text-only"


def document_facts(doc: Document, text_chars: int = UNKNOWN) -> DocumentFacts:
    return DocumentFacts(dataset=doc.dataset, modality=modality_of(doc),
                         image_sizes=tuple((i.height, i.width) for i in doc.images),
                         image_tokens=tuple(i.tokens for i in doc.images),
                         audio_seconds=tuple(a.seconds for a in doc.audio), num_generated=len(doc.generated),
                         text_tokens=doc.text_tokens, text_chars=text_chars, num_tokens=doc.num_tokens,
                         num_oriented_images=sum(s.orientation != 1 for s in (*doc.images, *doc.generated)),
                         num_oriented_videos=sum(s.orientation != 1 for s in doc.segments if isinstance(s, VideoRef)),
                         num_declared_size_mismatches=sum(i.declared_size is not None for i in doc.images))


def step_facts(plan: StepPlan) -> StepFacts:
    used = [seq for seq in plan.sequences if seq.documents]
    imbalance, arrival = plan.imbalance()
    sim = plan.simulation
    return StepFacts(step=plan.step, num_padding_sequences=len(plan.sequences) - len(used),
                     documents_per_sequence=tuple(len(seq.documents) for seq in used),
                     padding_share=tuple(seq.free_tokens / seq.seq_len for seq in used),
                     module_s=tuple((seq.cost.encoder_s, seq.cost.backbone_s, seq.cost.generator_s) for seq in used),
                     imbalance=float(imbalance), arrival_imbalance=float(arrival),
                     iteration_s=float(sim["iteration_s"]), arrival_iteration_s=float(sim["arrival_iteration_s"]),
                     lower_bound_s=float(sim["lower_bound_s"]))


def series(documents: Sequence[DocumentFacts], steps: Sequence[StepFacts],
           manifests: Iterable[ManifestLike] = ()) -> dict[str, np.ndarray]:
    """Named value arrays: per image, document, sequence, step, and (``manifest_*``) per row of
    the img2dataset manifests, sizes the manifest does not give left out."""
    sizes = np.array([hw for d in documents for hw in d.image_sizes], dtype=np.int64).reshape(-1, 2)
    modules = np.array([m for s in steps for m in s.module_s], dtype=float).reshape(-1, 3)
    out = {
        "image_width": sizes[:, 1], "image_height": sizes[:, 0], "image_megapixels": sizes.prod(axis=1) / 1e6,
        "image_tokens": _ints(t for d in documents for t in d.image_tokens),
        "audio_seconds": np.array([s for d in documents for s in d.audio_seconds], dtype=float),
        "text_chars": _ints(d.text_chars for d in documents if d.text_chars != UNKNOWN),
        "text_tokens": _ints(d.text_tokens for d in documents),
        "document_tokens": _ints(d.num_tokens for d in documents),
        "documents_per_sequence": _ints(n for s in steps for n in s.documents_per_sequence),
        "padding_share": np.array([p for s in steps for p in s.padding_share], dtype=float),
        "encoder_s": modules[:, 0], "backbone_s": modules[:, 1], "generator_s": modules[:, 2],
    }
    for name in ("imbalance", "arrival_imbalance", "iteration_s", "arrival_iteration_s", "lower_bound_s"):
        out[f"step_{name}"] = np.array([getattr(s, name) for s in steps], dtype=float)
    bound = np.maximum(out["step_lower_bound_s"], 1e-12)
    out["step_planned_over_bound"] = out["step_iteration_s"] / bound
    out["step_arrival_over_bound"] = out["step_arrival_iteration_s"] / bound
    manifests = list(manifests)
    for name in ("width", "height", "original_width", "original_height", "caption_chars"):
        values = np.concatenate([getattr(m, name) for m in manifests]) if manifests else _ints(())
        out[f"manifest_{name}"] = values[values != UNKNOWN]
    width = np.concatenate([m.original_width for m in manifests]) if manifests else _ints(())
    height = np.concatenate([m.original_height for m in manifests]) if manifests else _ints(())
    known = (width != UNKNOWN) & (height != UNKNOWN)
    out["manifest_original_megapixels"] = width[known] * height[known] / 1e6
    return out


def _ints(values: Iterable[int]) -> np.ndarray:
    return np.fromiter(values, dtype=np.int64)


def distribution(values: np.ndarray) -> dict:
    """count, min, p10, p50, p90, p99, max and mean of ``values`` (count only when empty)."""
    values = np.asarray(values)
    if not len(values):
        return {"count": 0}
    cuts = np.percentile(values, PERCENTILES)
    out = {"count": int(len(values)), "min": _number(values.min())}
    out.update({f"p{p}": _number(v) for p, v in zip(PERCENTILES, cuts)})
    out.update({"max": _number(values.max()), "mean": _number(values.mean())})
    return out


def _number(value) -> float | int:
    value = float(value)
    return int(value) if value.is_integer() and abs(value) < 2**53 else value


def compute_stats(documents: Sequence[DocumentFacts], steps: Sequence[StepFacts], *,
                  dataset_names: Sequence[str], skipped: Mapping[str, int], num_parsed: int,
                  manifests: Sequence[tuple[int, ManifestLike]] = (), num_shards: int = 0) -> dict:
    """The summary ``inspect`` prints: counts (read, accepted, skipped by kind, per modality and
    dataset), a distribution per series, the step totals, and what the manifests hold.

    ``num_parsed``: samples parsed into documents (those in ``documents`` and those read but not
    planned yet); ``manifests``: (dataset index, manifest) of the shards that have one."""
    values = series(documents, steps, (m for _, m in manifests))
    skipped_read = sum(n for kind, n in skipped.items() if kind != "download_failed")
    per_dataset = []
    for i, name in enumerate(dataset_names):
        mine = [m for d, m in manifests if d == i]
        per_dataset.append({"name": name, "planned": sum(1 for d in documents if d.dataset == i),
                            "modalities": _modalities(d for d in documents if d.dataset == i),
                            **_orientations(d for d in documents if d.dataset == i),
                            "manifest_shards": len(mine), "manifest_samples": sum(m.num_samples for m in mine),
                            "manifest_failed_rows": sum(m.num_failed for m in mine)})
    totals = {name: float(values[f"step_{name}"].sum()) for name in ("iteration_s", "arrival_iteration_s",
                                                                       "lower_bound_s")}
    return {
        "samples": {"read": num_parsed + skipped_read, "accepted": num_parsed, "planned": len(documents),
                    "skipped": skipped_read, "skipped_by_kind": dict(sorted(skipped.items(), key=lambda kv: -kv[1]))},
        "modalities": _modalities(documents),
        "num_generation_targets": sum(d.num_generated for d in documents),
        "orientations": _orientations(documents),
        "datasets": per_dataset,
        "sequences": {"count": int(len(values["padding_share"])),
                      "padding_sequences": sum(s.num_padding_sequences for s in steps)},
        "steps": {"count": len(steps), **{f"total_{k}": v for k, v in totals.items()}},
        "manifests": {"shards": len(manifests), "of_shards": num_shards,
                      "samples": sum(m.num_samples for _, m in manifests),
                      "failed_rows": sum(m.num_failed for _, m in manifests)},
        "distributions": {name: distribution(v) for name, v in values.items()},
    }


def _orientations(documents: Iterable[DocumentFacts]) -> dict[str, int]:
    """Samples with an image, a video, turned or mirrored for display; images whose manifest size
    disagreed with their bytes."""
    counts = {"samples_oriented_images": 0, "samples_oriented_videos": 0, "declared_size_mismatches": 0}
    for d in documents:
        counts["samples_oriented_images"] += d.num_oriented_images > 0
        counts["samples_oriented_videos"] += d.num_oriented_videos > 0
        counts["declared_size_mismatches"] += d.num_declared_size_mismatches
    return counts


def _modalities(documents: Iterable[DocumentFacts]) -> dict[str, int]:
    counts = dict.fromkeys(MODALITY_CLASSES, 0)
    for d in documents:
        counts[d.modality] += 1
    return counts
