"""Decoder-only LLM backbone over packed sequences. No distributed code.

Input: a microbatch's int32 tokens [S, L], position ids, and the encoders' outputs, which replace
the embeddings at the image and audio token spans (flattened S*L positions, the service's
image_spans / audio_spans). The microbatch runs flattened, [S*L, D]; attention is causal inside
each document and never crosses one (segments from cu_seqlens, layers.Attention). The blocks can
be cut into pipeline stages
(``stage_layers``); the first stage embeds, the last one normalises and predicts the next text
token (the LM loss is computed from the logits and the service's labels, see ``lm_loss``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.config import ModelConfig
from trainer.models.device import host_to
from trainer.models.layers import Block

IGNORE_INDEX = -100


def spans_index(spans, device: torch.device | str | None = None) -> torch.Tensor:
    """int64 positions covered by [start, end) spans, in order, on ``device``. ``spans``: (start,
    end) pairs, built on the host and copied without a sync; or a host [K, 2] tensor (the
    single-process reference's microbatch)."""
    if isinstance(spans, torch.Tensor):
        spans = spans.numpy().reshape(-1, 2).tolist()
    index = (np.concatenate([np.arange(s, e, dtype=np.int64) for s, e in spans]) if spans
             else np.zeros(0, dtype=np.int64))
    return host_to(torch.from_numpy(index), device or "cpu")


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.pos = nn.Embedding(config.max_positions, config.dim)
        self.blocks = nn.ModuleList(Block(config.dim, config.heads) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)

    def embed_inputs(self, tokens: torch.Tensor, position_ids: torch.Tensor, media: torch.Tensor,
                     media_index: torch.Tensor) -> torch.Tensor:
        """[1, S*L, D] input embeddings; ``media`` [K, D] replaces the K flattened positions ``media_index``."""
        x = self.embed(tokens.reshape(-1).long()) + self.pos(position_ids.reshape(-1).long())
        if media_index.numel():
            x = x.index_copy(0, media_index.to(x.device), media.to(x.dtype))
        return x[None]

    def run_blocks(self, x: torch.Tensor, cu_seqlens: list[int], first: int, last: int) -> torch.Tensor:
        for block in self.blocks[first:last]:
            x = block(x, cu_seqlens)
        return x

    def logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(final hidden states [S*L, D], next-token logits [S*L, V])."""
        h = self.norm(x[0])
        return h, self.head(h)


def stage_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous [first, last) block ranges of ``num_stages`` pipeline stages, as even as possible."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot cut {num_layers} blocks into {num_stages} stages")
    bounds = [round(i * num_layers / num_stages) for i in range(num_stages + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over the trained positions: sums, so microbatches and ranks add up to
    the mean over all the trained tokens of a step (``trained_tokens`` counts them, on the host).
    ``labels`` is the microbatch's (the service's loss mask applied: -100 on placeholders, padding,
    across documents and on untrained text such as a conversation's user turns)."""
    return F.cross_entropy(logits.float(), labels.reshape(-1).long(), ignore_index=IGNORE_INDEX, reduction="sum")


def trained_tokens(labels: torch.Tensor) -> int:
    """Positions a host ``labels`` tensor trains."""
    return int((labels.numpy() != IGNORE_INDEX).sum())
