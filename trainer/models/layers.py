"""Transformer building blocks shared by the encoder, backbone and generator."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"width {dim} is not divisible by {heads} heads")
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int] | None = None) -> torch.Tensor:
        """x [B, T, D]. With ``cu_seqlens`` (B = 1: a flattened packed microbatch), attention is
        causal inside each segment [cu[i], cu[i+1]) and never crosses one; computed per segment, so
        it costs the sum of squared document lengths, not the squared sequence length. Without it,
        full attention over each of the B rows (an image's patches)."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)
        if cu_seqlens is None:
            y = F.scaled_dot_product_attention(q, k, v)
        else:
            y = torch.cat([F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True)
                           for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]) if e > s], dim=2)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))

    def forward(self, x: torch.Tensor, cu_seqlens: list[int] | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens)
        return x + self.mlp(self.norm2(x))
