"""Modality encoders: a ViT-style image encoder and a log-mel audio encoder. No distributed code.

ImageEncoder: uint8 HWC images whose sides are multiples of patch_size * merge_size (as the
service sizes them) -> patches -> linear embedding + learned 2D position embedding ->
transformer blocks (each image attends within itself) -> merge_size x merge_size patch merging ->
projection to the backbone width. One output token per (patch_size * merge_size)^2 pixels: the
count the service planned.

AudioEncoder: float16 [frames, n_mels] log-mel clips -> linear -> groups of token_stride frames
concatenated and projected (one token per stride) -> transformer blocks -> backbone width.
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.models.config import ModelConfig
from trainer.models.layers import Block

MEAN = torch.tensor([0.481, 0.458, 0.408]) * 255
STD = torch.tensor([0.269, 0.261, 0.276]) * 255


class ImageEncoder(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        p, d = config.patch_size, config.enc_dim
        self.patch = nn.Linear(3 * p * p, d)
        self.row = nn.Embedding(config.max_patches_per_side, d)
        self.col = nn.Embedding(config.max_patches_per_side, d)
        self.blocks = nn.ModuleList(Block(d, config.enc_heads) for _ in range(config.enc_layers))
        self.norm = nn.LayerNorm(d)
        self.proj = nn.Linear(d * config.merge_size ** 2, config.dim)
        self.register_buffer("mean", MEAN.view(1, 1, 3), persistent=False)
        self.register_buffer("std", STD.view(1, 1, 3), persistent=False)

    def num_tokens(self, image: torch.Tensor) -> int:
        side = self.config.patch_size * self.config.merge_size
        return (image.shape[0] // side) * (image.shape[1] // side)

    def forward(self, images: list[torch.Tensor]) -> torch.Tensor:
        """N uint8 [H, W, 3] images -> [sum of their tokens, dim], images in order."""
        if not images:
            return self.proj.weight.new_zeros(0, self.config.dim)
        return torch.cat([self._one(image) for image in images])

    def _one(self, image: torch.Tensor) -> torch.Tensor:
        p, m = self.config.patch_size, self.config.merge_size
        x = (image.float() - self.mean) / self.std
        h, w = image.shape[0] // p, image.shape[1] // p
        patches = x.reshape(h, p, w, p, 3).permute(0, 2, 1, 3, 4).reshape(h, w, p * p * 3)
        rows = torch.arange(h, device=x.device).clamp(max=self.config.max_patches_per_side - 1)
        cols = torch.arange(w, device=x.device).clamp(max=self.config.max_patches_per_side - 1)
        z = self.patch(patches) + self.row(rows)[:, None] + self.col(cols)[None, :]
        z = z.reshape(1, h * w, -1)
        for block in self.blocks:
            z = block(z)
        z = self.norm(z).reshape(h // m, m, w // m, m, -1).permute(0, 2, 1, 3, 4).reshape((h // m) * (w // m), -1)
        return self.proj(z)


class AudioEncoder(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        d = config.enc_dim
        self.inp = nn.Linear(config.n_mels, d)
        self.group = nn.Linear(d * config.audio_token_stride, d)
        self.blocks = nn.ModuleList(Block(d, config.enc_heads) for _ in range(config.audio_layers))
        self.norm = nn.LayerNorm(d)
        self.proj = nn.Linear(d, config.dim)

    def forward(self, mels: list[torch.Tensor]) -> torch.Tensor:
        """A float16 [frames, n_mels] clips -> [sum of frames / stride, dim], clips in order."""
        if not mels:
            return self.proj.weight.new_zeros(0, self.config.dim)
        return torch.cat([self._one(mel) for mel in mels])

    def _one(self, mel: torch.Tensor) -> torch.Tensor:
        stride = self.config.audio_token_stride
        z = self.inp(mel.float() / 10.0)
        z = self.group(z.reshape(mel.shape[0] // stride, -1))[None]
        for block in self.blocks:
            z = block(z)
        return self.proj(self.norm(z[0]))
