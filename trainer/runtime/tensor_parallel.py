"""Tensor parallelism inside a module (Megatron-LM style), applied to an unmodified model.

``shard(module, tp)`` rewrites, in place, every transformer block (layers.Block) and diffusion
residual block (generator.ResBlock) under ``module`` so that TP rank r of ``tp.size`` keeps 1/size
of its weights:

- attention: the query/key/value projection keeps the heads of rank r (column parallel), the
  output projection the matching input columns (row parallel);
- MLP: the first linear keeps a contiguous 1/size of the hidden units (column parallel), the
  second the matching input columns (row parallel);
- residual block: the first convolution keeps 1/size of the output channels, FiLM the matching
  scale and shift rows, the GroupNorm between them whole groups of those channels (so it stays
  local), and the second convolution the matching input channels.

A column-parallel layer's input passes through ``f`` (identity forward, all-reduce of the input
gradient backward) and a row-parallel layer's partial output through ``g`` (all-reduce forward,
identity backward), its bias added once after the reduction. Everything else (norms,
embeddings, heads) stays replicated; its gradients are identical on every TP rank because its
inputs and output gradients are, so gradients need no TP reduction and DP reduction runs per TP
rank. Parameter order and names are those of the unsharded model; each sharded parameter carries
``tp_shard = (dim, index)``: the rows of the full parameter it holds, so checkpoints and tests can
map shards back to the full tensor.

Written out rather than with torch.distributed.tensor.parallel: its ColwiseParallel splits a
fused qkv weight by contiguous rows, not by heads, has no convolution styles, and turns the
parameters into DTensors that the runtime's point-to-point transfers, per-module gradient
reduction and checkpoints would all have to unwrap. The two autograd functions below are all the
communication there is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.models.generator import ResBlock
from trainer.models.layers import Block


@dataclass(frozen=True)
class TPGroup:
    rank: int
    """This process's index in its TP group."""
    size: int
    group: object = None
    """torch.distributed process group of the TP ranks (None when size == 1)."""
    ranks: tuple[int, ...] = ()
    """Global ranks of the group, TP rank 0 (the leader, which talks to other modules) first."""

    @property
    def leader(self) -> bool:
        return self.rank == 0


SOLO = TPGroup(0, 1)


class _CopyToTP(torch.autograd.Function):
    """f: identity forward; all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (half-precision partial sums are added in fp32, then rounded once);
    identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        total = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _shard_param(full: torch.Tensor, dim: int, index: torch.Tensor) -> nn.Parameter:
    p = nn.Parameter(full.detach().index_select(dim, index).clone())
    p.tp_shard = (dim, index)
    return p


class _Sharded(nn.Module):
    """A column- or row-parallel linear or convolution holding ``weight`` (and ``bias``) shards."""

    def __init__(self, full: nn.Module, kind: str, index: torch.Tensor, group, **conv):
        super().__init__()
        self.kind, self.group, self.conv = kind, group, conv
        self.weight = _shard_param(full.weight, 0 if kind == "column" else 1, index)
        if full.bias is not None:  # a row-parallel bias is added whole, after the reduction
            self.bias = (_shard_param(full.bias, 0, index) if kind == "column"
                         else nn.Parameter(full.bias.detach().clone()))
        else:
            self.bias = None

    def _apply_weight(self, x, bias):
        if self.conv:
            return F.conv2d(x, self.weight, bias, **self.conv)
        return F.linear(x, self.weight, bias)

    def forward(self, x):
        if self.kind == "column":
            return self._apply_weight(_CopyToTP.apply(x, self.group), self.bias)
        y = _ReduceFromTP.apply(self._apply_weight(x, None), self.group)
        if self.bias is None:
            return y
        return y + (self.bias[:, None, None] if self.conv else self.bias)


class _ShardedGroupNorm(nn.Module):
    def __init__(self, full: nn.GroupNorm, size: int, index: torch.Tensor):
        super().__init__()
        self.groups, self.eps = full.num_groups // size, full.eps
        self.weight = _shard_param(full.weight, 0, index)
        self.bias = _shard_param(full.bias, 0, index)

    def forward(self, x):
        return F.group_norm(x, self.groups, self.weight, self.bias, self.eps)


def _chunk(n: int, tp: TPGroup) -> torch.Tensor:
    if n % tp.size:
        raise ValueError(f"{n} units do not split over TP {tp.size}")
    return torch.arange(tp.rank * n // tp.size, (tp.rank + 1) * n // tp.size)


def _shard_block(block: Block, tp: TPGroup) -> None:
    attn = block.attn
    if attn.heads % tp.size:
        raise ValueError(f"{attn.heads} attention heads do not split over TP {tp.size}")
    dim, hd = attn.out.in_features, attn.head_dim
    heads = _chunk(attn.heads, tp)
    cols = (heads[:, None] * hd + torch.arange(hd)).reshape(-1)  # this rank's heads' channels
    rows = torch.cat([j * dim + cols for j in range(3)])  # their q, k and v rows
    attn.qkv = _Sharded(attn.qkv, "column", rows, tp.group)
    attn.out = _Sharded(attn.out, "row", cols, tp.group)
    hidden = _chunk(block.mlp[0].out_features, tp)
    block.mlp[0] = _Sharded(block.mlp[0], "column", hidden, tp.group)
    block.mlp[2] = _Sharded(block.mlp[2], "row", hidden, tp.group)


def _shard_resblock(block: ResBlock, tp: TPGroup) -> None:
    if block.norm2.num_groups % tp.size:
        raise ValueError(f"GroupNorm of {block.norm2.num_groups} groups does not split over TP {tp.size}")
    channels = block.conv1.out_channels
    mine = _chunk(channels, tp)
    block.conv1 = _Sharded(block.conv1, "column", mine, tp.group, padding=1)
    block.film = _Sharded(block.film, "column", torch.cat([mine, channels + mine]), tp.group)
    block.norm2 = _ShardedGroupNorm(block.norm2, tp.size, mine)
    block.conv2 = _Sharded(block.conv2, "row", mine, tp.group, padding=1)


def shard(module: nn.Module, tp: TPGroup) -> nn.Module:
    """Shards every Block and ResBlock under ``module`` for TP rank ``tp.rank``; no-op for size 1."""
    if tp.size == 1:
        return module
    for sub in list(module.modules()):
        if isinstance(sub, Block):
            _shard_block(sub, tp)
        elif isinstance(sub, ResBlock):
            _shard_resblock(sub, tp)
    return module


def full_slice(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The part of the unsharded ``full`` that ``param`` holds (``full`` itself if not sharded)."""
    spec = getattr(param, "tp_shard", None)
    return full if spec is None else full.index_select(spec[0], spec[1])
