"""Tensor-parallel shards (gloo, CPU processes) against the unsharded modules."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from disttrain_api.layout import PipelineLayout
from trainer.models.config import ModelConfig
from trainer.models.generator import DiffusionGenerator
from trainer.models.layers import Block
from trainer.runtime.tensor_parallel import TPGroup, full_slice, shard


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forward_backward(module, x, **kw):
    x = x.clone().requires_grad_()
    y = module(x, **kw)
    (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()  # a non-uniform output gradient
    return y.detach(), x.grad


def _check(rank: int, size: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    torch.set_num_threads(1)
    try:
        tp = TPGroup(rank, size, dist.new_group(list(range(size))), tuple(range(size)))
        cases = []
        torch.manual_seed(0)
        block = Block(32, 4)
        x = torch.randn(1, 23, 32)
        cases.append((block, x, {"cu_seqlens": [0, 9, 23]}))
        config = ModelConfig(dim=16, gen_channels=32)
        gen = DiffusionGenerator(config)
        images = torch.randint(0, 255, (3, 32, 32, 3), dtype=torch.uint8)
        queries = torch.randn(3, 5, 16)
        for module, inp, kw in cases:
            full = [p.detach().clone() for p in module.parameters()]
            want_y, want_dx = _forward_backward(module, inp, **kw)
            want_grads = [p.grad.clone() for p in module.parameters()]
            module.zero_grad()
            shard(module, tp)
            got_y, got_dx = _forward_backward(module, inp, **kw)
            torch.testing.assert_close(got_y, want_y, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_dx, want_dx, rtol=1e-5, atol=1e-5)
            params = list(module.parameters())
            assert len(params) == len(full)
            assert sum(p.numel() for p in params) < sum(p.numel() for p in full)  # it holds less
            for p, f, g in zip(params, full, want_grads):
                torch.testing.assert_close(p.detach(), full_slice(f, p))
                torch.testing.assert_close(p.grad, full_slice(g, p), rtol=1e-5, atol=1e-5)
        # the generator: ResBlocks sharded by channel; its loss and every gradient match
        want = gen.loss(queries.clone().requires_grad_(), images, torch.Generator().manual_seed(3))
        full = [p.detach().clone() for p in gen.parameters()]
        want.backward()
        want_grads = [p.grad.clone() for p in gen.parameters()]
        gen.zero_grad()
        shard(gen, tp)
        got = gen.loss(queries.clone().requires_grad_(), images, torch.Generator().manual_seed(3))
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for p, f, g in zip(gen.parameters(), full, want_grads):
            torch.testing.assert_close(p.detach(), full_slice(f, p))
            torch.testing.assert_close(p.grad, full_slice(g, p), rtol=1e-4, atol=1e-6)
        results[rank] = "ok"
    except Exception as e:  # reported to the parent, which fails the test with it
        results[rank] = repr(e)
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_blocks_match_the_unsharded_ones(size):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_check, args=(size, _free_port(), results), nprocs=size, join=True)
        assert dict(results) == {r: "ok" for r in range(size)}


def test_shard_refuses_a_split_that_does_not_divide():
    block = Block(24, 3)
    with pytest.raises(ValueError, match="3 attention heads do not split over TP 2"):
        shard(block, TPGroup(0, 2))


def test_layout_with_tensor_parallel_groups():
    layout = PipelineLayout(enc_dp=1, bb_dp=2, bb_pp=2, gen_dp=1, enc_tp=2, bb_tp=2, gen_tp=2)
    assert layout.world_size == 2 + 8 + 2
    assert [layout.role(r) for r in (0, 1, 2, 3, 4, 5, 6, 9, 10, 11)] == [
        ("enc", 0), ("enc", 0), ("bb", 0, 0), ("bb", 0, 0), ("bb", 1, 0), ("bb", 1, 0), ("bb", 0, 1), ("bb", 1, 1),
        ("gen", 0), ("gen", 0)]
    assert layout.bb_rank(1, 1, 1) == 9 and layout.tp_rank(9) == 1 and layout.tp_ranks(9) == [8, 9]
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert layout.groups()["bb1.tp1"] == [7, 9]  # stage 1, TP rank 1 of DP 0 and of DP 1
    assert layout.group_of(9) == "bb1.tp1" and layout.group_of(11) == "gen.tp1"
    every = sorted(r for ranks in layout.groups().values() for r in ranks)
    assert every == list(range(layout.world_size))  # each rank reduces in exactly one group


def test_half_precision_partial_sums_are_reduced_in_fp32(monkeypatch):
    """Under bf16 autocast a row-parallel layer's partial outputs are bf16; adding TP ranks' partials
    in bf16 rounds at every addition (1 + 3 x 2^-9 ... stays 1), so they are reduced in fp32 and
    rounded once."""
    from trainer.runtime import tensor_parallel

    reduced = []
    monkeypatch.setattr(tensor_parallel.dist, "all_reduce",
                        lambda tensor, group=None: reduced.append(tensor.dtype) or tensor.mul_(4))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.full((3,), 1.0, dtype=dtype)
        y = tensor_parallel._ReduceFromTP.apply(x, None)
        assert y.dtype == dtype and torch.equal(y, torch.full((3,), 4.0, dtype=dtype))
    assert reduced == [torch.float32] * 3
