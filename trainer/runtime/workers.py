"""One worker per role of the disaggregated pipeline: it owns its module's parameters and runs
its ops of one step (``PipelineLayout.ops``: the order the service's simulator times), exchanging
activations and gradients point-to-point (p2p.py).

Backbone stage 0 of chain d reads chain d's microbatches from the service (DataClient for DP rank
d), sends each microbatch's images and audio to its encoder replica, receives the encoder's
output tokens and embeds them at the media spans. The last backbone stage computes the LM loss
and sends the hidden states at each image-to-generate's query tokens to the generator replica,
which computes the diffusion loss and sends their gradient back. The LM loss is over the tokens
the service's labels train (Microbatch.labels, travelling down the chain with the hidden states).
Losses are scaled by the step's global counts (trained text tokens, images to generate), which
stage 0 all-reduces over the backbone DP ranks (on a CPU group) at the start of the step and
passes down the chain, so summed gradients equal those of the single-process reference
(mllm.step_loss).

What a microbatch's host code needs (its document boundaries, the spans of images to generate, its
noise seed, the step's counts) is read once from the client's host tensors at stage 0 and travels
as message metadata (``MicrobatchMeta``), never read back from a device: the ops of a step make no
host sync (no ``.item()``, ``.tolist()`` or ``synchronize`` on a device tensor). Busy time is
measured with CUDA events on a GPU and read after the step's one sync (``finish_step``). Each
worker moves only the modules it runs to its device (``modules``).

With TP > 1 every rank of a TP group runs the same ops on its shard of the module
(tensor_parallel.py); only the group's leader (TP rank 0) exchanges tensors with other modules
and stages, and forwards what it receives to the others, which therefore need no data client.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from disttrain_api.layout import PipelineLayout
from trainer.models.backbone import IGNORE_INDEX, lm_loss, spans_index, stage_layers
from trainer.models.device import host_to
from trainer.models.mllm import MultimodalModel, microbatch_seed
from trainer.models.video import fold_videos
from trainer.runtime.p2p import Channels, Outbox, recv
from trainer.runtime.tensor_parallel import SOLO, TPGroup, shard


@dataclass
class MicrobatchMeta:
    """The host-side facts about one microbatch that travel with it as message metadata."""

    dp: int
    m: int
    seed: int
    cu_seqlens: list[int]
    gen_spans: list[tuple[int, int]]
    lm_total: int = 0
    """Trained text tokens of the whole step (all DP ranks)."""
    gen_total: int = 0
    """Images to generate in the whole step (all DP ranks)."""

    def to_ints(self) -> list[int]:
        return [self.dp, self.m, self.seed, self.lm_total, self.gen_total, len(self.cu_seqlens), *self.cu_seqlens,
                len(self.gen_spans), *(v for span in self.gen_spans for v in span)]

    @classmethod
    def from_ints(cls, values: list[int]) -> MicrobatchMeta:
        dp, m, seed, lm_total, gen_total, n = values[:6]
        cu = values[6:6 + n]
        g = values[6 + n]
        flat = values[7 + n:7 + n + 2 * g]
        return cls(dp, m, seed, cu, list(zip(flat[::2], flat[1::2])), lm_total, gen_total)


def _pairs(spans: torch.Tensor) -> list[tuple[int, int]]:
    """A host [K, 2] span tensor as (start, end) pairs (numpy: a device tensor cannot be read here)."""
    return [(int(s), int(e)) for s, e in spans.numpy().reshape(-1, 2)]


def message_pairs(layout: PipelineLayout, num_microbatches: int) -> list[tuple[str, int, int]]:
    """(kind, sender, receiver) of every point-to-point message the workers of ``layout`` exchange
    in a step of up to ``num_microbatches`` microbatches (p2p.connect opens them at start-up)."""
    pairs = []
    last = layout.bb_pp - 1
    for d in range(layout.bb_dp):
        stage0 = layout.bb_rank(d, 0)
        if layout.enc_dp:
            for e in {layout.enc_of(d, m) for m in range(num_microbatches)}:
                enc = layout.enc_rank(e)
                pairs += [("media", stage0, enc), ("embed", enc, stage0), ("embed_grad", stage0, enc)]
        for s in range(last):
            a, b = layout.bb_rank(d, s), layout.bb_rank(d, s + 1)
            pairs += [("act", a, b), ("act_grad", b, a)]
        if layout.gen_dp:
            for g in {layout.gen_of(d, m) for m in range(num_microbatches)}:
                tail, gen = layout.bb_rank(d, last), layout.gen_rank(g)
                pairs += [("gen", tail, gen), ("gen_grad", gen, tail)]
    for ranks in layout.tp_groups():
        pairs += [("tp", ranks[0], peer) for peer in ranks[1:]]
    return pairs


class Worker:
    def __init__(self, model: MultimodalModel, layout: PipelineLayout, num_microbatches: int, seed: int,
                 tp: TPGroup = SOLO, device: torch.device | str = "cpu", channels: Channels | None = None):
        self.model, self.layout, self.M, self.seed, self.tp = model, layout, num_microbatches, seed, tp
        self.device = torch.device(device)
        """Where this rank's modules, activations and messages live (``to_device`` moves them)."""
        self.channels = channels or Channels.default()
        self.trace: list[tuple[str, int, int]] = []
        """(op, chain, microbatch) this step, in the order run; encoder and generator take the chain
        and microbatch from the message they received (what the layout test compares with the
        simulator)."""
        self.outbox = Outbox(self.channels, self.device)
        self.busy_s = 0.0
        self.per_microbatch: dict[tuple[int, int], float] = {}
        """Busy seconds per (chain dp, microbatch) this step: the timings fed back to the service."""
        self._current = (0, 0)
        self._events: list[tuple[tuple[int, int], object, object]] = []
        self.loss_parts = torch.zeros(2, dtype=torch.float64)
        """This rank's share of the step loss: (LM part, generation part), already normalised; on
        the device, read once per step."""

    def modules(self) -> list[nn.Module]:
        """The modules this rank runs (and holds on its device)."""
        raise NotImplementedError

    def parameters(self) -> list[nn.Parameter]:
        return [p for module in self.modules() for p in module.parameters()]

    def to_device(self) -> None:
        """Moves this rank's modules (and nothing else of the model) to its device."""
        for module in self.modules():
            module.to(self.device)
        self.loss_parts = self.loss_parts.to(self.device)

    def begin_step(self, num_microbatches: int) -> None:
        self.M, self.trace, self.busy_s, self.per_microbatch, self._events = num_microbatches, [], 0.0, {}, []
        self.loss_parts = torch.zeros(2, dtype=torch.float64, device=self.device)

    def finish_step(self) -> None:
        """Adds the step's CUDA event timings to busy_s and per_microbatch: call after the step's
        host sync (the events have completed then; elapsed_time does not wait)."""
        for key, start, end in self._events:
            elapsed = start.elapsed_time(end) / 1000
            self.busy_s += elapsed
            self.per_microbatch[key] = self.per_microbatch.get(key, 0.0) + elapsed
        self._events = []

    def run_step(self, step: int) -> None:
        raise NotImplementedError

    module_index = 0
    """0 encoder, 1 backbone, 2 generator: the column of this worker's timings."""

    def _recv(self, src: int, kind: str) -> tuple[list[torch.Tensor], list[int]]:
        """A message from another module or stage: the TP leader receives it from ``src`` and
        forwards it to the other TP ranks, which take it from the leader."""
        if not self.tp.leader:
            return recv(self.channels, self.tp.ranks[0], "tp", self.device)
        tensors, meta = recv(self.channels, src, kind, self.device)
        self._to_peers(tensors, meta)
        return tensors, meta

    def _to_peers(self, tensors: list[torch.Tensor], meta: list[int] = ()) -> None:
        for peer in self.tp.ranks[1:]:
            self.outbox.send(tensors, peer, "tp", meta)

    def _send(self, tensors: list[torch.Tensor], dst: int, kind: str, meta: list[int] = ()) -> None:
        """To another module or stage: the TP leader sends (every TP rank holds the same tensors)."""
        if self.tp.leader:
            self.outbox.send(tensors, dst, kind, meta)

    def _add_loss(self, part: int, value: torch.Tensor) -> None:
        if self.tp.leader:  # each TP rank computes the same loss; it counts once
            self.loss_parts[part] += value.detach().to(torch.float64)

    def _timed(self, fn, *args):
        """Runs fn and counts its time as busy: on a GPU between two CUDA events (read at
        finish_step, no sync here), else the host's seconds."""
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args)
            end.record()
            self._events.append((self._current, start, end))
            return out
        began = time.perf_counter()
        try:
            return fn(*args)
        finally:
            elapsed = time.perf_counter() - began
            self.busy_s += elapsed
            self.per_microbatch[self._current] = self.per_microbatch.get(self._current, 0.0) + elapsed


class EncoderWorker(Worker):
    def __init__(self, *args, replica: int, **kw):
        super().__init__(*args, **kw)
        self.replica = replica
        shard(self.model.image_encoder, self.tp)
        shard(self.model.audio_encoder, self.tp)

    def modules(self):
        return [self.model.image_encoder, self.model.audio_encoder]

    def run_step(self, step: int) -> None:
        saved = {}
        for op, d, m in self.layout.stage_model().stage_ops(0, self.replica, self.M):
            src, self._current = self.layout.bb_rank(d, 0), (d, m)
            if op == "F":
                media, (num_images, _, sent_d, sent_m) = self._recv(src, "media")
                self.trace.append((op, sent_d, sent_m))
                images, mels = media[:num_images], media[num_images:]
                out = self._timed(lambda: torch.cat([self.model.image_encoder(images), self.model.audio_encoder(mels)]))  # noqa: B023 (_timed calls it at once)
                if out.shape[0]:
                    self._send([out], src, "embed")
                    saved[(d, m)] = out
                continue
            self.trace.append((op, d, m))
            if (d, m) in saved:
                grad = self._recv(src, "embed_grad")[0][0]
                self._timed(saved.pop((d, m)).backward, grad)


class GeneratorWorker(Worker):
    module_index = 2

    def __init__(self, *args, replica: int, gen_weight: float, **kw):
        super().__init__(*args, **kw)
        self.replica, self.gen_weight = replica, gen_weight
        shard(self.model.generator, self.tp)

    def modules(self):
        return [self.model.generator]

    def run_step(self, step: int) -> None:
        last = self.layout.num_stages - 1
        saved = {}
        for op, d, m in self.layout.stage_model().stage_ops(last, self.replica, self.M):
            src, self._current = self.layout.bb_rank(d, self.layout.bb_pp - 1), (d, m)
            if op == "B":
                self.trace.append((op, d, m))
                if (d, m) in saved:
                    queries, scaled = saved.pop((d, m))
                    self._timed(scaled.backward)
                    self._send([queries.grad], src, "gen_grad")
                continue
            (queries, images), (seed, total, sent_d, sent_m) = self._recv(src, "gen")
            self.trace.append((op, sent_d, sent_m))
            if queries.shape[0] == 0:
                continue
            queries.requires_grad_()

            def forward():
                # called at once, by _timed below, in this iteration
                loss = self.model.generator.loss(queries, images, torch.Generator().manual_seed(seed))  # noqa: B023
                return self.gen_weight * loss / max(total, 1)  # noqa: B023
            scaled = self._timed(forward)
            self._add_loss(1, scaled)
            saved[(d, m)] = (queries, scaled)


class BackboneWorker(Worker):
    module_index = 1

    def __init__(self, *args, dp: int, stage: int, client=None, stage0_group=None, **kw):
        super().__init__(*args, **kw)
        self.dp, self.stage, self.client = dp, stage, client
        self.stage0_group = stage0_group
        """CPU (gloo) group of the backbone's stage-0 ranks of TP rank 0: the step's counts."""
        self._first = None
        self.keys_log = None
        """A file the data rank appends "STEP KEY" lines to, one per sample it receives (--keys-log)."""
        self.first, self.last = stage == 0, stage == self.layout.bb_pp - 1
        self.blocks = stage_layers(self.model.config.layers, self.layout.bb_pp)[stage]
        self.local_encoder = self.first and self.layout.enc_dp == 0
        self.local_generator = self.last and self.layout.gen_dp == 0
        self._media: dict[int, tuple] = {}
        for block in self.model.backbone.blocks[self.blocks[0]:self.blocks[1]]:
            shard(block, self.tp)
        if self.local_encoder:
            shard(self.model.image_encoder, self.tp)
            shard(self.model.audio_encoder, self.tp)
        if self.local_generator:
            shard(self.model.generator, self.tp)

    def modules(self):
        bb = self.model.backbone
        out: list[nn.Module] = list(bb.blocks[self.blocks[0]:self.blocks[1]])
        if self.first:
            out += [bb.embed, bb.pos]
        if self.last:
            out += [bb.norm, bb.head]
        if self.local_encoder:
            out += [self.model.image_encoder, self.model.audio_encoder]
        if self.local_generator:
            out.append(self.model.generator)
        return out

    def peek_num_microbatches(self, step: int) -> int:
        """Stage 0: reads the step's first microbatch; the step has this many (the last step of an
        epoch may have fewer than the job's num_microbatches)."""
        self._first = next(self.client)
        if self._first.step != step:
            raise RuntimeError(f"rank {self.dp} expected step {step}, the service sent step {self._first.step}")
        return self._first.num_microbatches

    def _read_step(self, step: int) -> list[tuple[list[torch.Tensor], MicrobatchMeta]]:
        """Stage 0: the step's microbatches from the service, media sent to the encoders, global
        counts all-reduced; returns each microbatch's device tensors (tokens, positions, labels,
        media index, images to generate) and host metadata. The other TP ranks of the stage get the
        same from their leader."""
        if not self.tp.leader:
            return [self._peer_meta(m, *recv(self.channels, self.tp.ranks[0], "tp", self.device))
                    for m in range(self.M)]
        hosts, counts = [], np.zeros(2, dtype=np.int64)
        for m in range(self.M):
            mb, self._first = (self._first, None) if m == 0 and self._first is not None else (next(self.client), None)
            if (mb.step, mb.microbatch_index) != (step, m):
                raise RuntimeError(f"rank {self.dp} expected step {step} microbatch {m}, the service sent "
                                   f"step {mb.step} microbatch {mb.microbatch_index}")
            hosts.append(fold_videos(mb, self.model.config.patch_size * self.model.config.merge_size))
            counts += (int((mb.labels.numpy() != IGNORE_INDEX).sum()), int(mb.gen_spans.shape[0]))
        # the step's counts first, then the media: a rank never sits in this collective with sends
        # to an encoder posted that the encoder's other chains may be waiting behind
        totals = torch.from_numpy(counts)
        dist.all_reduce(totals, group=self.stage0_group)  # a CPU group: no device round trip
        lm_total, gen_total = (int(v) for v in totals.numpy())
        if self.keys_log is not None:
            with open(self.keys_log, "a") as f:
                f.writelines(f"{step} {key}\n" for mb in hosts for key in mb.sample_keys)
        out = []
        for m, mb in enumerate(hosts):
            # host facts from the client's host tensors, before anything moves to the device
            meta = MicrobatchMeta(self.dp, m, microbatch_seed(self.seed, step, self.dp, m),
                                  mb.cu_seqlens.numpy().tolist(), _pairs(mb.gen_spans), lm_total, gen_total)
            index = spans_index(_pairs(mb.image_spans) + _pairs(mb.audio_spans))
            if self.device.type != "cpu":
                mb = mb.to(self.device, non_blocking=True)  # from the client's pinned buffers
                index = host_to(index, self.device)
            if self.local_encoder:
                self._media[m] = (mb.images, mb.mels)
            else:
                self._send([*mb.images, *mb.mels], self.layout.enc_rank(self.layout.enc_of(self.dp, m)), "media",
                           [len(mb.images), len(mb.mels), self.dp, m])
            out.append(([mb.tokens, mb.position_ids, mb.labels, index, mb.gen_images], meta))
        for m, (tensors, meta) in enumerate(out):
            images, mels = self._media.get(m, ([], []))
            self._to_peers([*tensors, *images, *mels], [len(images), len(mels), *meta.to_ints()])
        return out

    def _peer_meta(self, m: int, tensors: list[torch.Tensor], ints: list[int]):
        num_images, num_mels, meta = ints[0], ints[1], MicrobatchMeta.from_ints(ints[2:])
        media = tensors[5:]
        if self.local_encoder:
            self._media[m] = (media[:num_images], media[num_images:num_images + num_mels])
        return tensors[:5], meta

    def run_step(self, step: int) -> None:
        inputs = self._read_step(step) if self.first else [None] * self.M
        saved = {}
        for op, d, m in self.layout.stage_model().stage_ops(self.layout.chain_stage(self.stage), self.dp, self.M):
            self._current = (d, m)
            self.trace.append((op, d, m))
            if op == "F":
                saved[m] = self._forward(m, inputs[m])
            else:
                self._backward(m, saved.pop(m))

    def _forward(self, m: int, inputs):
        bb = self.model.backbone
        media = None
        if self.first:
            (tokens, positions, labels, index, gen_images), meta = inputs
            if index.numel() and self.local_encoder:
                images, mels = self._media.pop(m)
                media = self._timed(lambda: torch.cat([self.model.image_encoder(images),
                                                       self.model.audio_encoder(mels)]))
            elif index.numel():
                media = self._recv(self.layout.enc_rank(self.layout.enc_of(self.dp, m)), "embed")[0][0]
                media.requires_grad_()
            none = torch.zeros(0, bb.embed.embedding_dim, device=self.device)
            x = self._timed(bb.embed_inputs, tokens, positions, none if media is None else media, index)
        else:
            (x, labels, gen_images), ints = self._recv(self.layout.bb_rank(self.dp, self.stage - 1), "act")
            meta = MicrobatchMeta.from_ints(ints)
            x.requires_grad_()
        y = self._timed(bb.run_blocks, x, meta.cu_seqlens, *self.blocks)
        if not self.last:
            self._send([y, labels, gen_images], self.layout.bb_rank(self.dp, self.stage + 1), "act", meta.to_ints())
            return x, media, [y], None
        hidden, logits = self._timed(bb.logits, y)
        lm_sum = self._timed(lm_loss, logits, labels)
        scaled = lm_sum / max(meta.lm_total, 1)
        self._add_loss(0, scaled)
        num_gen = len(meta.gen_spans)
        queries = hidden[spans_index(meta.gen_spans, self.device)].reshape(num_gen, -1 if num_gen else 0,
                                                                          hidden.shape[-1])
        if self.local_generator:
            outputs = [scaled]
            if num_gen:
                gen = self._timed(self.model.generator.loss, queries, gen_images,
                                  torch.Generator().manual_seed(meta.seed))
                gen_scaled = self.model.config.gen_loss_weight * gen / max(meta.gen_total, 1)
                self._add_loss(1, gen_scaled)
                outputs.append(gen_scaled)
            return x, media, outputs, (None, m)
        self._send([queries, gen_images], self.layout.gen_rank(self.layout.gen_of(self.dp, m)), "gen",
                   [meta.seed, meta.gen_total, self.dp, m])
        return x, media, [scaled], (queries if num_gen else None, m)

    def _backward(self, m: int, saved) -> None:
        x, media, outputs, gen = saved
        if self.last:
            grads = [torch.ones_like(o) for o in outputs]
            if gen[0] is not None:
                outputs = outputs + [gen[0]]
                grads.append(self._recv(self.layout.gen_rank(self.layout.gen_of(self.dp, m)), "gen_grad")[0][0])
        else:
            grads = self._recv(self.layout.bb_rank(self.dp, self.stage + 1), "act_grad")[0]
        self._timed(torch.autograd.backward, outputs, grads)
        if not self.first:
            self._send([x.grad], self.layout.bb_rank(self.dp, self.stage - 1), "act_grad")
        elif media is not None and not self.local_encoder:
            self._send([media.grad], self.layout.enc_rank(self.layout.enc_of(self.dp, m)), "embed_grad")
