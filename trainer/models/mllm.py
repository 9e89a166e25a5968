"""The whole multimodal model in one process: the single-process reference the disaggregated
pipeline must match, and the definition of the loss. No distributed code.

loss of a step = (sum of LM cross-entropy over every trained text token) / (their number)
               + gen_loss_weight * (sum of noise-prediction MSE over every image to generate) / (their number)
Microbatches return sums and counts, so however a step is cut into microbatches, ranks and
pipeline stages, the loss and its gradients are the same. Which text tokens are trained is the
service's decision (``mb.labels``, from its loss mask): never placeholders, padding or the first
token of another document, and in a conversation only the assistant's turns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trainer.models.backbone import Backbone, lm_loss, spans_index, trained_tokens
from trainer.models.config import ModelConfig
from trainer.models.encoder import AudioEncoder, ImageEncoder
from trainer.models.generator import DiffusionGenerator
from trainer.models.video import fold_videos


@dataclass(slots=True)
class LossParts:
    lm_sum: torch.Tensor
    lm_count: int
    gen_sum: torch.Tensor
    gen_count: int


def microbatch_seed(seed: int, step: int, rank: int, index: int) -> int:
    """Seed of the diffusion noise of one microbatch: the same wherever it is computed."""
    return (seed * 1_000_003 + step * 10_007 + rank * 101 + index) % (2 ** 63)


def media_index(mb, device: torch.device | str | None = None) -> torch.Tensor:
    """Flattened positions of the encoders' outputs (image spans, then audio spans) of a host
    microbatch, on ``device``."""
    return torch.cat([spans_index(mb.image_spans, device), spans_index(mb.audio_spans, device)])


def step_loss(parts: list[LossParts], gen_weight: float) -> torch.Tensor:
    lm_count = max(sum(p.lm_count for p in parts), 1)
    gen_count = max(sum(p.gen_count for p in parts), 1)
    return (sum(p.lm_sum for p in parts) / lm_count + gen_weight * sum(p.gen_sum for p in parts) / gen_count)


class MultimodalModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.image_encoder = ImageEncoder(config)
        self.audio_encoder = AudioEncoder(config)
        self.backbone = Backbone(config)
        self.generator = DiffusionGenerator(config)

    def encode(self, mb) -> torch.Tensor:
        return torch.cat([self.image_encoder(mb.images), self.audio_encoder(mb.mels)])

    def forward(self, mb, noise: torch.Generator, device: torch.device | str | None = None) -> LossParts:
        """The losses of a host microbatch ``mb``, computed on ``device`` (default: the host)."""
        mb = fold_videos(mb, self.config.patch_size * self.config.merge_size)
        cu = mb.cu_seqlens.numpy().tolist()
        index, gen_index = media_index(mb, device), spans_index(mb.gen_spans, device)
        lm_count, num_gen = trained_tokens(mb.labels), int(mb.gen_spans.shape[0])
        if device is not None:
            mb = mb.to(device)
        x = self.backbone.embed_inputs(mb.tokens, mb.position_ids, self.encode(mb), index)
        x = self.backbone.run_blocks(x, cu, 0, self.config.layers)
        hidden, logits = self.backbone.logits(x)
        lm_sum = lm_loss(logits, mb.labels)
        queries = hidden[gen_index].reshape(num_gen, -1 if num_gen else 0, hidden.shape[-1])
        gen_sum = self.generator.loss(queries, mb.gen_images, noise)
        return LossParts(lm_sum, lm_count, gen_sum, num_gen)
