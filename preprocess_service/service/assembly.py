"""Microbatch assembly: one planned microbatch of one rank -> its layout, its decoding submitted,
then its arrays (core/assemble.py lays out and finishes; the decoder fills the buffer)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from disttrain_api.config import JobConfig
from disttrain_api.errors import repeatable
from preprocess_service.adapters.decode import WORKER_DIED, Decoded, Decoder
from preprocess_service.adapters.plugins.hooks import (
    DEFAULT_LIMITS,
    HookCosts,
    HookLimits,
    HookSpec,
    is_plugin_failure,
)
from preprocess_service.adapters.plugins.registry import plugin_class
from preprocess_service.core.assemble import Layout, MicrobatchArrays, compact, finish, layout_microbatch
from preprocess_service.core.packing import PackedSequence
from preprocess_service.core.planner import StepPlan
from preprocess_service.core.tokenizer import Tokenizer
from preprocess_service.service.plans import PlanSource
from preprocess_service.service.report import SkippedRecord


@dataclass(slots=True)
class PendingMicrobatch:
    """A microbatch whose decoding is under way."""

    sequences: list[PackedSequence]
    layout: Layout
    future: Future
    skipped: list[SkippedRecord]
    """Planned documents that could not even be re-read (they are not in ``sequences``)."""


class Assembly:
    """Lays out and decodes the microbatches of one job's plans (``plans``: where their documents'
    media come from, and where failures are reported)."""

    def __init__(self, config: JobConfig, tokenizer: Tokenizer, plans: PlanSource,
                 first_out: threading.Event | None = None, plugin_limits: HookLimits = DEFAULT_LIMITS,
                 on_hook_costs: Callable[[HookCosts], None] | None = None):
        self.config, self.tokenizer, self.plans = config, tokenizer, plans
        self.plugin_limits = plugin_limits
        self.on_hook_costs = on_hook_costs
        """Told what the media hooks spent on each decoded microbatch (the job's PluginCosts)."""
        self.media_plugins = tuple(p for p in config.plugins if plugin_class(p.name).has_media_hook())
        self.first_out = first_out or threading.Event()
        """Set when the job's first microbatch is decoded (side files wait for it)."""

    def hooks(self, epoch: int) -> HookSpec | None:
        """What the decoder needs to run the job's media hooks on a step of ``epoch``."""
        if not self.media_plugins:
            return None
        return HookSpec(self.media_plugins, self.config.seed, epoch, self.plugin_limits)

    def layout(self, sequences: list[PackedSequence], skip: frozenset[str] = frozenset()) -> Layout:
        return layout_microbatch(sequences, seq_len=self.config.seq_len, tokenizer=self.tokenizer,
                                 audio_config=self.config.audio, skip=skip)

    def start(self, plan: StepPlan, rank: int, index: int, decoder: Decoder,
              stop: threading.Event | None = None) -> PendingMicrobatch:
        """Lays out one microbatch of ``rank`` and submits its decoding to ``decoder``
        (adapters/decode/), which may wait for room in the memory budget until ``stop`` is set."""
        sequences, skipped = self.plans.resolve(plan.microbatch(rank, index), plan.epoch)
        layout = self.layout(sequences)
        future = decoder.submit(layout, stop, self.hooks(plan.epoch))
        for seq in sequences:  # copies of the plan's documents: the decoder has taken their bytes already
            for doc in seq.documents:
                doc.media_bytes = None
        self.plans.taken(plan, rank, index)  # and so has it the plan's: a stream that needs them re-reads them
        return PendingMicrobatch(sequences, layout, future, skipped)

    def finish(self, pending: PendingMicrobatch) -> tuple[MicrobatchArrays, Callable[[], None], Callable | None]:
        """Waits for the decode; returns the arrays (views of the decode buffer), the function
        that releases that buffer once the arrays are no longer needed, and the decoder's lend
        (Decoded.lend: None where the buffer cannot be lent to a client). Documents that failed to
        decode are left out, reported in ``arrays.skipped`` and recorded in the job's report."""
        decoded: Decoded = pending.future.result()
        if decoded.hook_costs and self.on_hook_costs is not None:
            self.on_hook_costs(decoded.hook_costs)
        layout, buffer, release, lend = pending.layout, decoded.buffer, decoded.release, decoded.lend
        if decoded.errors:
            survivors = self.layout(pending.sequences, skip=frozenset(decoded.errors))
            buffer = compact(layout, buffer, survivors)
            decoded.release()
            layout, release, lend = survivors, (lambda: None), None
        arrays = finish(layout, buffer)
        self.first_out.set()
        shards_of = {doc.key: doc.shard for seq in pending.sequences for doc in seq.documents}
        arrays.skipped.extend(pending.skipped)
        failed = [SkippedRecord(key, shards_of[key], f"decode failed: {repeatable(reason)}", _kind(reason))
                  for key, reason in decoded.errors.items()]
        arrays.skipped.extend(failed)
        if failed:
            self.plans.lost(failed)
        return arrays, release, lend

    def copy(self, plan: StepPlan, rank: int, index: int, decoder: Decoder) -> MicrobatchArrays:
        """One microbatch decoded and copied out of the decode buffer (for tests and tools)."""
        arrays, release, _ = self.finish(self.start(plan, rank, index, decoder))
        arrays.arrays = {name: np.array(a) for name, a in arrays.arrays.items()}
        release()
        return arrays


def _kind(reason: str) -> str:
    """The report's kind of a document that failed to decode, from its reason."""
    if reason.startswith(WORKER_DIED):
        return "decode_worker_died"
    return "plugin_failed" if is_plugin_failure(reason) else "decode_failed"
