"""A step plan as the bytes a replica commits to Redis, and back.

A record names every document by (shard, key, token count) and keeps each sequence's cost, the
assignment of sequences to ranks and microbatches, the arrival-order baseline and the
simulator's verdict: all a replica needs to stream any microbatch of the step, re-reading only
that microbatch's samples from their shards. The encoding is canonical (sorted JSON, zlib), so
two replicas that plan the same step write identical bytes.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass

import numpy as np

from preprocess_service.core.cost import SequenceCost
from preprocess_service.core.packing import PackedSequence
from preprocess_service.core.planner import StepPlan

RECORD_VERSION = 1


@dataclass(slots=True)
class DocRef:
    """A planned document named by where it lives; resolved to a Document by re-reading its sample."""

    key: str
    shard: str
    num_tokens: int
    """Tokens the plan gave it: the re-parsed document must have exactly as many."""


def encode(plan: StepPlan, *, cost_model: dict | None = None, features: list | None = None) -> bytes:
    """``cost_model`` (the coefficients the step was priced with) and ``features`` (each sequence's
    cost-model features, feedback.microbatch_features) are kept for jobs with cost feedback: a
    replaying planner prices the step as it was, and any replica turns reported timings into
    observations without re-reading samples."""
    shard_urls: dict[str, int] = {}
    sequences = []
    for seq in plan.sequences:
        docs = [[shard_urls.setdefault(doc.shard, len(shard_urls)), doc.key, doc.num_tokens] for doc in seq.documents]
        cost = seq.cost
        sequences.append({"docs": docs, "cost": [cost.encoder_s, cost.backbone_s, cost.generator_s, cost.total_s]})
    record = {
        "version": RECORD_VERSION, "step": plan.step, "epoch": plan.epoch,
        "seq_len": plan.sequences[0].seq_len if plan.sequences else 0,
        "shards": list(shard_urls), "sequences": sequences,
        "assignment": plan.assignment.tolist(), "baseline": plan.baseline_assignment.tolist(),
        "simulation": plan.simulation,
    }
    if cost_model is not None:
        record["cost_model"] = cost_model
    if features is not None:
        record["features"] = features
    return zlib.compress(json.dumps(record, sort_keys=True, separators=(",", ":")).encode(), 6)


def decode(data: bytes) -> StepPlan:
    """The StepPlan of a record; its sequences hold DocRefs instead of Documents."""
    record = json.loads(zlib.decompress(data))
    if record.get("version") != RECORD_VERSION:
        raise ValueError(f"plan record has version {record.get('version')!r}, this replica reads {RECORD_VERSION}")
    urls = record["shards"]
    sequences = [PackedSequence(seq_len=record["seq_len"],
                                # DocRefs stand in for the Documents until resolved (see the docstring)
                                documents=[DocRef(key, urls[shard], tokens)  # type: ignore[misc]
                                           for shard, key, tokens in seq["docs"]],
                                cost=SequenceCost(*seq["cost"]))
                 for seq in record["sequences"]]
    return StepPlan(step=record["step"], epoch=record["epoch"], sequences=sequences,
                    assignment=np.array(record["assignment"], dtype=np.int64),
                    baseline_assignment=np.array(record["baseline"], dtype=np.int64),
                    simulation=record["simulation"])


def feedback_fields(data: bytes) -> tuple[dict | None, list | None]:
    """(cost_model, features) of a record (None where the job has no cost feedback)."""
    record = json.loads(zlib.decompress(data))
    return record.get("cost_model"), record.get("features")
