"""One worker per role of the disaggregated pipeline: it owns its module's parameters and runs
its ops of one step (``PipelineLayout.ops``: the order the service's simulator times), exchanging
activations and gradients point-to-point (p2p.py).

Backbone stage 0 of chain d reads chain d's microbatches from the service (DataClient for DP rank
d), sends each microbatch's images and audio to its encoder replica, receives the encoder's
output tokens and embeds them at the media spans. The last backbone stage computes the LM loss
and sends the hidden states at each image-to-generate's query tokens to the generator replica,
which computes the diffusion loss and sends their gradient back. The LM loss is over the tokens
the service's labels train (Microbatch.labels, travelling down the chain with the tokens).
Losses are scaled by the step's global counts (trained text tokens, images to generate), which
stage 0 all-reduces over the backbone DP ranks at the start of the step and passes down the
chain, so summed gradients equal those of the single-process reference (mllm.step_loss).

With TP > 1 every rank of a TP group runs the same ops on its shard of the module
(tensor_parallel.py); only the group's leader (TP rank 0) exchanges tensors with other modules
and stages, and forwards what it receives to the others, which therefore need no data client.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from disttrain_api.layout import PipelineLayout
from trainer.models.backbone import IGNORE_INDEX, lm_loss, spans_index, stage_layers
from trainer.models.mllm import MultimodalModel, media_index, microbatch_seed
from trainer.runtime.p2p import Outbox, recv
from trainer.runtime.tensor_parallel import SOLO, TPGroup, shard


class Worker:
    def __init__(self, model: MultimodalModel, layout: PipelineLayout, num_microbatches: int, seed: int,
                 tp: TPGroup = SOLO, device: torch.device | str = "cpu"):
        self.model, self.layout, self.M, self.seed, self.tp = model, layout, num_microbatches, seed, tp
        self.device = torch.device(device)
        """Where this rank's module, activations and messages live (the model is moved by the caller)."""
        self.trace: list[tuple[str, int, int]] = []
        """(op, chain, microbatch) this step, in the order run; encoder and generator take the chain
        and microbatch from the message they received (what the layout test compares with the
        simulator)."""
        self.outbox = Outbox(self.device)
        self.busy_s = 0.0
        self.per_microbatch: dict[tuple[int, int], float] = {}
        """Busy seconds per (chain dp, microbatch) this step: the timings fed back to the service."""
        self._current = (0, 0)
        self.loss_parts = torch.zeros(2, dtype=torch.float64)
        """This rank's share of the step loss: (LM part, generation part), already normalised."""

    def parameters(self) -> list[torch.nn.Parameter]:
        raise NotImplementedError

    def run_step(self, step: int) -> None:
        raise NotImplementedError

    module_index = 0
    """0 encoder, 1 backbone, 2 generator: the column of this worker's timings."""

    def _recv(self, src: int, kind: str) -> list[torch.Tensor]:
        """A message from another module or stage: the TP leader receives it from ``src`` and
        forwards it to the other TP ranks, which take it from the leader."""
        if not self.tp.leader:
            return recv(self.tp.ranks[0], "tp", self.device)
        tensors = recv(src, kind, self.device)
        self._to_peers(tensors)
        return tensors

    def _to_peers(self, tensors: list[torch.Tensor]) -> None:
        for peer in self.tp.ranks[1:]:
            self.outbox.send(tensors, peer, "tp")

    def _send(self, tensors: list[torch.Tensor], dst: int, kind: str) -> None:
        """To another module or stage: the TP leader sends (every TP rank holds the same tensors)."""
        if self.tp.leader:
            self.outbox.send(tensors, dst, kind)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _add_loss(self, part: int, value: float) -> None:
        if self.tp.leader:  # each TP rank computes the same loss; it counts once
            self.loss_parts[part] += value

    def _timed(self, fn, *args):
        """Runs fn and counts its seconds as busy; on a GPU after the device finished its kernels."""
        self._sync()
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._sync()
            elapsed = time.perf_counter() - start
            self.busy_s += elapsed
            self.per_microbatch[self._current] = self.per_microbatch.get(self._current, 0.0) + elapsed


class EncoderWorker(Worker):
    def __init__(self, *args, replica: int, **kw):
        super().__init__(*args, **kw)
        self.replica = replica
        shard(self.model.image_encoder, self.tp)
        shard(self.model.audio_encoder, self.tp)

    def parameters(self):
        return [*self.model.image_encoder.parameters(), *self.model.audio_encoder.parameters()]

    def run_step(self, step: int) -> None:
        saved = {}
        for op, d, m in self.layout.stage_model().stage_ops(0, self.replica, self.M):
            src, self._current = self.layout.bb_rank(d, 0), (d, m)
            if op == "F":
                counts, *media = self._recv(src, "media")
                self.trace.append((op, *counts[2:].tolist()))
                images, mels = media[:int(counts[0])], media[int(counts[0]):]
                out = self._timed(lambda: torch.cat([self.model.image_encoder(images), self.model.audio_encoder(mels)]))  # noqa: B023 (_timed calls it at once)
                if out.shape[0]:
                    self._send([out], src, "embed")
                    saved[(d, m)] = out
                continue
            self.trace.append((op, d, m))
            if (d, m) in saved:
                grad = self._recv(src, "embed_grad")[0]
                self._timed(saved.pop((d, m)).backward, grad)


class GeneratorWorker(Worker):
    module_index = 2

    def __init__(self, *args, replica: int, gen_weight: float, **kw):
        super().__init__(*args, **kw)
        self.replica, self.gen_weight = replica, gen_weight
        shard(self.model.generator, self.tp)

    def parameters(self):
        return list(self.model.generator.parameters())

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
            queries, images, seed, total, ident = self._recv(src, "gen")
            self.trace.append((op, *ident.tolist()))
            if queries.shape[0] == 0:
                continue
            queries.requires_grad_()

            def forward():
                # called at once, by _timed below, in this iteration
                loss = self.model.generator.loss(queries, images, torch.Generator().manual_seed(int(seed)))  # noqa: B023
                return self.gen_weight * loss / total.double().clamp(min=1).item()  # noqa: B023
            scaled = self._timed(forward)
            self._add_loss(1, scaled.item())
            saved[(d, m)] = (queries, scaled)


class BackboneWorker(Worker):
    module_index = 1

    def __init__(self, *args, dp: int, stage: int, client=None, stage0_group=None, **kw):
        super().__init__(*args, **kw)
        self.dp, self.stage, self.client, self.stage0_group = dp, stage, client, stage0_group
        self._first = None
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

    def parameters(self):
        bb = self.model.backbone
        params = [p for block in bb.blocks[self.blocks[0]:self.blocks[1]] for p in block.parameters()]
        if self.first:
            params += [*bb.embed.parameters(), *bb.pos.parameters()]
        if self.last:
            params += [*bb.norm.parameters(), *bb.head.parameters()]
        if self.local_encoder:
            params += [*self.model.image_encoder.parameters(), *self.model.audio_encoder.parameters()]
        if self.local_generator:
            params += list(self.model.generator.parameters())
        return params

    def peek_num_microbatches(self, step: int) -> int:
        """Stage 0: reads the step's first microbatch; the step has this many (the last step of an
        epoch may have fewer than the job's num_microbatches)."""
        self._first = next(self.client)
        if self._first.step != step:
            raise RuntimeError(f"rank {self.dp} expected step {step}, the service sent step {self._first.step}")
        return self._first.num_microbatches

    def _read_step(self, step: int) -> list[list[torch.Tensor]]:
        """Stage 0: the step's microbatches from the service, media sent to the encoders, global
        counts all-reduced; returns each microbatch's metadata as it travels down the chain. The
        other TP ranks of the stage get the same from their leader."""
        if not self.tp.leader:
            return [self._peer_meta(m, recv(self.tp.ranks[0], "tp", self.device)) for m in range(self.M)]
        metas, counts = [], torch.zeros(2, dtype=torch.float64, device=self.device)
        for m in range(self.M):
            mb, self._first = (self._first, None) if m == 0 and self._first is not None else (next(self.client), None)
            if (mb.step, mb.microbatch_index) != (step, m):
                raise RuntimeError(f"rank {self.dp} expected step {step} microbatch {m}, the service sent "
                                   f"step {mb.step} microbatch {mb.microbatch_index}")
            if self.device.type != "cpu":
                mb = mb.to(self.device, non_blocking=True)  # from the client's pinned buffers
            trained = (mb.labels != IGNORE_INDEX).sum().item()
            counts += torch.tensor([trained, mb.gen_spans.shape[0]], dtype=torch.float64, device=self.device)
            if self.local_encoder:
                self._media[m] = (mb.images, mb.mels)
            else:
                self._send([torch.tensor([len(mb.images), len(mb.mels), self.dp, m]), *mb.images, *mb.mels],
                           self.layout.enc_rank(self.layout.enc_of(self.dp, m)), "media")
            seed = torch.tensor([microbatch_seed(self.seed, step, self.dp, m)])
            metas.append([mb.tokens, mb.position_ids, mb.labels, mb.cu_seqlens, media_index(mb),
                          mb.gen_spans, mb.gen_images, seed, counts])  # counts: filled in below, shared
        dist.all_reduce(counts, group=self.stage0_group)
        for m, meta in enumerate(metas):
            images, mels = self._media.get(m, ([], []))
            self._to_peers([*meta, torch.tensor([len(images), len(mels)]), *images, *mels])
        return metas

    def _peer_meta(self, m: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        meta, (num_images, _), media = tensors[:9], tensors[9].tolist(), tensors[10:]
        if self.local_encoder:
            self._media[m] = (media[:num_images], media[num_images:])
        return meta

    def run_step(self, step: int) -> None:
        metas = self._read_step(step) if self.first else [None] * self.M
        saved = {}
        for op, d, m in self.layout.stage_model().stage_ops(self.layout.chain_stage(self.stage), self.dp, self.M):
            self._current = (d, m)
            self.trace.append((op, d, m))
            if op == "F":
                saved[m] = self._forward(step, m, metas[m])
            else:
                self._backward(m, saved.pop(m))

    def _forward(self, step: int, m: int, meta):
        bb = self.model.backbone
        media = None
        if self.first:
            tokens, positions, labels, cu, index, gen_spans, gen_images, seed, counts = meta
            if index.numel() and self.local_encoder:
                images, mels = self._media.pop(m)
                media = self._timed(lambda: torch.cat([self.model.image_encoder(images),
                                                       self.model.audio_encoder(mels)]))
            elif index.numel():
                media = self._recv(self.layout.enc_rank(self.layout.enc_of(self.dp, m)), "embed")[0].requires_grad_()
            none = torch.zeros(0, bb.embed.embedding_dim, device=self.device)
            x = self._timed(bb.embed_inputs, tokens, positions, none if media is None else media, index)
        else:
            x, *meta = self._recv(self.layout.bb_rank(self.dp, self.stage - 1), "act")
            x.requires_grad_()
            tokens, positions, labels, cu, index, gen_spans, gen_images, seed, counts = meta
        y = self._timed(bb.run_blocks, x, cu.tolist(), *self.blocks)
        if not self.last:
            self._send([y, *meta], self.layout.bb_rank(self.dp, self.stage + 1), "act")
            return x, media, [y], None
        hidden, logits = self._timed(bb.logits, y)
        lm_sum, _ = self._timed(lm_loss, logits, labels)
        scaled = lm_sum / counts[0].clamp(min=1).item()
        self._add_loss(0, scaled.item())
        num_gen = gen_spans.shape[0]
        queries = hidden[spans_index(gen_spans)].reshape(num_gen, -1 if num_gen else 0, hidden.shape[-1])
        if self.local_generator:
            outputs = [scaled]
            if num_gen:
                gen = self._timed(self.model.generator.loss, queries, gen_images,
                                  torch.Generator().manual_seed(int(seed)))
                gen_scaled = self.model.config.gen_loss_weight * gen / counts[1].clamp(min=1).item()
                self._add_loss(1, gen_scaled.item())
                outputs.append(gen_scaled)
            return x, media, outputs, (None, m)
        self._send([queries, gen_images, seed, counts[1:2], torch.tensor([self.dp, m])],
                   self.layout.gen_rank(self.layout.gen_of(self.dp, m)), "gen")
        return x, media, [scaled], (queries if num_gen else None, m)

    def _backward(self, m: int, saved) -> None:
        x, media, outputs, gen = saved
        if self.last:
            grads = [torch.ones_like(o) for o in outputs]
            if gen[0] is not None:
                outputs = outputs + [gen[0]]
                grads.append(self._recv(self.layout.gen_rank(self.layout.gen_of(self.dp, m)), "gen_grad")[0])
        else:
            grads = self._recv(self.layout.bb_rank(self.dp, self.stage + 1), "act_grad")
        self._timed(torch.autograd.backward, outputs, grads)
        if not self.first:
            self._send([x.grad], self.layout.bb_rank(self.dp, self.stage - 1), "act_grad")
        elif media is not None and not self.local_encoder:
            self._send([media.grad], self.layout.enc_rank(self.layout.enc_of(self.dp, m)), "embed_grad")
