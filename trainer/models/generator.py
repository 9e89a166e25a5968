"""Image generator: a small diffusion model conditioned on backbone hidden states. No distributed code.

Training objective (DDPM, epsilon prediction, cosine noise schedule): the target image x0 (the
service's gen_pixels, resized to ``gen_resolution``, scaled to [-1, 1]) is noised to
x_t = sqrt(a_t) x0 + sqrt(1 - a_t) eps at a random step t, and the network predicts eps from x_t,
t and the condition: the backbone's final hidden states at the image's query tokens (attention-
pooled). The randomness comes from a torch.Generator the caller seeds, so a distributed run and a
single-process run draw the same t and eps.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.config import ModelConfig
from trainer.models.device import host_to


def cosine_alphas(steps: int) -> torch.Tensor:
    """Cumulative signal level a_t for t = 0..steps-1 (Nichol & Dhariwal's cosine schedule)."""
    t = torch.arange(steps + 1, dtype=torch.float64) / steps
    f = torch.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
    return (f[1:] / f[0]).clamp(1e-5, 1.0).float()


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, channels: int, cond_dim: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(8, channels)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.film = nn.Linear(cond_dim, 2 * channels)
        self.norm2 = nn.GroupNorm(8, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        scale, shift = self.film(cond)[:, :, None, None].chunk(2, dim=1)
        h = self.norm2(h) * (1 + scale) + shift
        return x + self.conv2(F.silu(h))


class DiffusionGenerator(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        c, d = config.gen_channels, config.dim
        self.pool_query = nn.Parameter(torch.randn(d) / math.sqrt(d))
        self.cond = nn.Sequential(nn.Linear(2 * d, d), nn.SiLU(), nn.Linear(d, d))
        self.inp = nn.Conv2d(3, c, 3, padding=1)
        self.down = nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.blocks = nn.ModuleList(ResBlock(c, d) for _ in range(2))
        self.up = nn.ConvTranspose2d(c, c, 4, stride=2, padding=1)
        self.out = nn.Conv2d(2 * c, 3, 3, padding=1)
        self.register_buffer("alphas", cosine_alphas(config.diffusion_steps), persistent=False)

    def condition(self, query_states: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """[R, Q, D] query-token hidden states and steps [R] -> [R, D]."""
        weights = torch.softmax(query_states @ self.pool_query / math.sqrt(query_states.shape[-1]), dim=1)
        pooled = (weights[..., None] * query_states).sum(dim=1)
        return self.cond(torch.cat([pooled, timestep_embedding(t, query_states.shape[-1])], dim=-1))

    def predict_noise(self, x_t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        h0 = self.inp(x_t)
        h = self.down(h0)
        for block in self.blocks:
            h = block(h, cond)
        return self.out(torch.cat([self.up(h), h0], dim=1))

    def loss(self, query_states: torch.Tensor, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Summed noise-prediction MSE (per image: mean over pixels) of R images.

        query_states [R, Q, D]; images uint8 [R, H, W, 3]."""
        if images.shape[0] == 0:
            return query_states.sum() * 0.0
        r = self.config.gen_resolution
        x0 = images.permute(0, 3, 1, 2).float() / 127.5 - 1.0
        if x0.shape[-1] != r:
            x0 = F.interpolate(x0, size=(r, r), mode="area")
        # drawn on the CPU from the caller's generator (the same numbers on every device), then
        # copied without a host sync
        t = host_to(torch.randint(0, self.config.diffusion_steps, (x0.shape[0],), generator=generator), x0.device)
        eps = host_to(torch.randn(x0.shape, generator=generator), x0.device)
        a = self.alphas[t][:, None, None, None]
        x_t = a.sqrt() * x0 + (1 - a).sqrt() * eps
        predicted = self.predict_noise(x_t, self.condition(query_states, t))
        return ((predicted - eps) ** 2).mean(dim=(1, 2, 3)).sum()
