"""Measured per-module costs of this trainer's model on the job's own microbatches: what the
trainer sends the service when it opens a job (its cost model) and what the orchestration
planner picks a layout from.

One process times the forward and the backward of the encoder, the backbone and the generator on
a few real microbatches (the first is a warm-up and not counted), and divides by what the cost
model counts: encoder tokens, non-padding backbone tokens, images to generate. The fit is linear
(the quadratic attention terms are left at 0); with ``--feedback`` the service refits it from the
running job's timings.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from disttrain_api.config import CostConfig, JobConfig
from trainer.models.backbone import lm_loss, spans_index
from trainer.models.config import ModelConfig
from trainer.models.mllm import MultimodalModel, media_index
from trainer.orchestration.planner import Problem
from trainer.orchestration.profile import Accelerator, Content, MeasuredProfile

PROBE_SEED_OFFSET = 7919
"""The probe job reads the same shards with another seed, so it is a different job than the run's."""


@dataclass(frozen=True, slots=True)
class Measured:
    """Forward seconds per unit of work, backward / forward factors, and the mean microbatch."""

    enc_s_per_token: float
    bb_s_per_token: float
    gen_s_per_image: float
    bwd_factor: tuple[float, float, float]
    content: Content
    microbatches: int

    def cost_config(self) -> CostConfig:
        return CostConfig(enc_linear_s=self.enc_s_per_token, enc_quadratic_s=0.0, bb_linear_s=self.bb_s_per_token,
                          bb_quadratic_s=0.0, gen_per_image_s=self.gen_s_per_image,
                          enc_backward_factor=self.bwd_factor[0], bb_backward_factor=self.bwd_factor[1],
                          gen_backward_factor=self.bwd_factor[2])

    def problem(self, num_procs: int, global_batch: int, layers: int) -> Problem:
        """The planner's problem for ``num_procs`` CPU processes (no TP on CPU)."""
        acc = Accelerator("CPU process", peak_flops=1e11, efficiency=1.0, memory_bytes=1e12, tp_link_bytes_s=1e9,
                          dp_link_bytes_s=1e12, max_tp=1)
        enc, bb, gen = self.bwd_factor
        return Problem(encoder=MeasuredProfile("enc", 1e6, (0, 0, self.enc_s_per_token, 0), bwd_factor=enc,
                                               accelerator=acc),
                       backbone=MeasuredProfile("bb", 1e6, (self.bb_s_per_token, 0, 0, 0), bwd_factor=bb,
                                                accelerator=acc),
                       generator=MeasuredProfile("gen", 1e6, (0, 0, 0, self.gen_s_per_image), bwd_factor=gen,
                                                 accelerator=acc),
                       content=self.content, global_batch=global_batch, seqs_per_microbatch=1,
                       num_gpus=num_procs, accelerator=acc, backbone_layers=layers)

    SIZE = 10
    """Numbers in ``as_list``."""

    def as_list(self) -> list[float]:
        c = self.content
        return [self.enc_s_per_token, self.bb_s_per_token, self.gen_s_per_image, *self.bwd_factor,
                c.tokens, c.image_tokens, c.gen_images, self.microbatches]

    @classmethod
    def from_list(cls, v: list[float]) -> Measured:
        return cls(v[0], v[1], v[2], (v[3], v[4], v[5]), Content(int(v[6]), int(v[7]), v[8]), int(v[9]))

    FIELDS = ("enc_s_per_token", "bb_s_per_token", "gen_s_per_image", "enc_bwd_factor", "bb_bwd_factor",
              "gen_bwd_factor", "mean_tokens", "mean_encoder_tokens", "mean_gen_images", "microbatches")
    """Keys of ``save``'s JSON, in ``as_list`` order."""
    MAX_VALUE = 1e9

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(dict(zip(self.FIELDS, self.as_list())), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Measured:
        """Costs ``save`` wrote; a missing or unknown key, or a value that is not a finite number in
        [0, 1e9], is a ValueError naming it."""
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or set(data) != set(cls.FIELDS):
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{path}: expected the keys {list(cls.FIELDS)}, got {got}")
        for key, value in data.items():
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or not 0 <= value <= cls.MAX_VALUE):
                raise ValueError(f"{path}: {key} must be a finite number in [0, {cls.MAX_VALUE:g}], got {value!r}")
        return cls.from_list([float(data[k]) for k in cls.FIELDS])


def _timer(device: torch.device):
    """fn -> (its result, its seconds): on a GPU after the device finished its kernels (profiling,
    not the training loop: a sync per op is what makes the timing true)."""
    def timed(fn):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out, time.perf_counter() - start
    return timed


def _ratio(num: float, den: float, default: float = 0.0) -> float:
    return num / den if den > 0 else default


def measure(address: str | list[str], config: JobConfig, model_layers: int, microbatches: int = 3,
            device: torch.device | str = "cpu", bf16: bool = False, vocab_size: int | None = None) -> Measured:
    """Times each module on ``microbatches`` microbatches of a probe job (dp_size 1, arrival order),
    on the training's ``device`` and precision (``bf16``: the training's autocast), so the service
    and the planner price the hardware the run uses."""
    device = torch.device(device)
    _timed = _timer(device)
    probe = dataclasses.replace(config, dp_size=1, num_microbatches=1, reorder_algorithm="arrival",
                                seed=config.seed + PROBE_SEED_OFFSET, enc_shared_by=1, gen_shared_by=1,
                                stage_map=("enc", "bb", "gen"), cost_feedback=False)
    sizes = {"vocab_size": vocab_size} if vocab_size else {}
    model = MultimodalModel(ModelConfig(layers=model_layers, max_positions=config.seq_len, **sizes)).to(device)
    sums = torch.zeros(3, 3, dtype=torch.float64)  # rows enc, bb, gen; columns forward s, backward s, work
    content = torch.zeros(3, dtype=torch.float64)
    from trainer import DataClient  # the client (gRPC) only where a probe runs

    with DataClient(address, probe, 0, prefetch=2) as client:
        for i in range(microbatches + 1):
            host = next(client)
            cu, index = host.cu_seqlens.numpy().tolist(), media_index(host, device)
            enc_tokens = len(spans_index(host.image_spans)) + len(spans_index(host.audio_spans))
            text, num_gen = int((host.modality.numpy() != 0).sum()), int(host.gen_spans.shape[0])
            span = int(host.gen_spans[0, 1] - host.gen_spans[0, 0]) if num_gen else 0  # query tokens per image
            mb = host.to(device, non_blocking=False)
            autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
            with autocast:
                media, enc_f = _timed(lambda: model.encode(mb))  # noqa: B023 (called at once)
            enc_b = 0.0
            if media.shape[0]:
                _, enc_b = _timed(lambda: media.float().sum().backward())  # noqa: B023
            bb = model.backbone
            with autocast:
                x = bb.embed_inputs(mb.tokens, mb.position_ids, media.detach(), index)

            def backbone_loss():
                with autocast:  # noqa: B023
                    return lm_loss(bb.logits(bb.run_blocks(x, cu, 0, model_layers))[1], mb.labels)  # noqa: B023
            loss, bb_f = _timed(backbone_loss)
            _, bb_b = _timed(loss.backward)
            gen_f = gen_b = 0.0
            if num_gen:
                queries = torch.randn(num_gen, span, model.config.dim, device=device, requires_grad=True)

                def generator_loss():
                    with autocast:  # noqa: B023
                        return model.generator.loss(queries, mb.gen_images, torch.Generator().manual_seed(0))  # noqa: B023
                gen_loss, gen_f = _timed(generator_loss)
                _, gen_b = _timed(gen_loss.backward)
            model.zero_grad(set_to_none=True)
            if i == 0:
                continue  # warm-up: first-call allocations
            sums += torch.tensor([[enc_f, enc_b, enc_tokens], [bb_f, bb_b, text], [gen_f, gen_b, num_gen]],
                                 dtype=torch.float64)
            content += torch.tensor([text, enc_tokens, num_gen], dtype=torch.float64)
        client.close_job()  # the probe job is done: free its slot and its plans on the service
    n = max(microbatches, 1)
    per = [_ratio(float(sums[i, 0]), float(sums[i, 2])) for i in range(3)]
    bwd = tuple(_ratio(float(sums[i, 1]), float(sums[i, 0]), 2.0) for i in range(3))
    return Measured(per[0], per[1], per[2], (bwd[0], bwd[1], bwd[2]),
                    Content(int(content[0] / n), int(content[1] / n), float(content[2]) / n), microbatches)


def _measure_in_process(address: str | list[str], config: JobConfig, layers: int, microbatches: int) -> list[float]:
    torch.set_num_threads(1)
    return measure(address, config, layers, microbatches).as_list()


def measure_concurrently(address: str | list[str], configs: list[JobConfig], model_layers: int,
                         microbatches: int = 3) -> Measured:
    """``measure`` of each config in its own (spawned) process, all at once, e.g. one per core with
    a probe seed each: the costs with every core busy, as in a run; their mean."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(len(configs)) as pool:
        results = pool.starmap(_measure_in_process, [(address, c, model_layers, microbatches) for c in configs])
    return Measured.from_list([sum(column) / len(results) for column in zip(*results)])
