"""Fits the cost model's coefficients (config.CostConfig) from timings of real torch modules.

    python -m disttrain_tools calibrate [--out cost.json] [--quick]

Until the trainer's own modules exist, the timed modules are stand-in blocks of the same shape:
* encoder: ViT blocks (pre-norm self-attention + MLP) over one image's t tokens;
* backbone: Llama-like decoder blocks over a packed sequence; projections and MLP run over all n
  tokens, causal attention per document (what a varlen attention kernel does);
* generator: a small convolutional denoiser over one image at the target resolution.
For each it times forward and forward+backward on this machine (one thread, median of a few runs),
fits the model of cost.py by non-negative least squares, and prints every coefficient with the fit's
error on the timed points. The JSON it writes is a CostConfig that ``run`` and ``serve`` accept with
``--cost FILE``. Absolute numbers are this CPU's; what matters for planning is their ratios.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from disttrain_api.config import CostConfig
from preprocess_service.core.cost import Fit, fit_nonnegative  # noqa: F401 (part of this module's API)


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _fwd_bwd_times(module, make_input, repeats: int) -> tuple[float, float]:
    import torch

    def forward():
        with torch.no_grad():
            module(make_input())

    def forward_backward():
        module(make_input()).float().square().mean().backward()

    fwd = _time(forward, repeats)
    both = _time(forward_backward, repeats)
    return fwd, max(both - fwd, 0.0)


def _stand_ins(width: int):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            self.heads = 4

        def forward(self, x, lengths, causal):
            q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
            parts, start = [], 0
            for n in lengths:  # attention inside each document / image only
                shape = (1, n, self.heads, width // self.heads)
                qs, ks, vs = (t[start:start + n].reshape(shape).transpose(1, 2) for t in (q, k, v))
                parts.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
                             .transpose(1, 2).reshape(n, width))
                start += n
            x = x + self.out(torch.cat(parts))
            return x + self.mlp(self.norm2(x))

    class Stack(nn.Module):
        def __init__(self, depth, causal):
            super().__init__()
            self.blocks, self.causal = nn.ModuleList(Block() for _ in range(depth)), causal

        def forward(self, batch):
            x, lengths = batch
            for block in self.blocks:
                x = block(x, lengths, self.causal)
            return x

    denoiser = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.SiLU(), nn.Conv2d(32, 32, 3, padding=1), nn.SiLU(),
                             nn.Conv2d(32, 3, 3, padding=1))
    return Stack(2, causal=False), Stack(2, causal=True), denoiser


def calibrate(*, quick: bool = False, width: int = 128, gen_resolution: int = 64, log=print) -> tuple[CostConfig, dict]:
    """Times the stand-in modules and fits CostConfig; returns it and a report of every fit."""
    import torch

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        encoder, backbone, generator = _stand_ins(width)
        repeats = 3 if quick else 5

        def tokens(n):
            return torch.randn(n, width, requires_grad=False)

        # Encoder: one image of t tokens.
        enc_t = [64, 256, 512, 1024] if quick else [64, 128, 256, 512, 768, 1024, 1536]
        enc = [_fwd_bwd_times(encoder, lambda t=t: (tokens(t), [t]), repeats) for t in enc_t]
        enc_fit = fit_nonnegative(np.array([[t, t * t] for t in enc_t]), np.array([f for f, _ in enc]))
        # Backbone: n tokens split into documents of one length each time.
        n = 2048 if quick else 4096
        doc_lens = [64, 256, 1024, 2048] if quick else [64, 128, 256, 512, 1024, 2048, 4096]
        bb_cases = [(n, [d] * (n // d)) for d in doc_lens] + [(n // 2, [n // 2])]
        bb = [_fwd_bwd_times(backbone, lambda L=L: (tokens(sum(L)), L), repeats) for _, L in bb_cases]
        bb_fit = fit_nonnegative(np.array([[sum(L), sum(d * d for d in L)] for _, L in bb_cases]),
                                 np.array([f for f, _ in bb]))
        # Generator: k images at the target resolution.
        gen_k = [1, 2, 4] if quick else [1, 2, 3, 4, 6]
        gen = [_fwd_bwd_times(generator, lambda k=k: torch.randn(k, 3, gen_resolution, gen_resolution), repeats)
               for k in gen_k]
        gen_fit = fit_nonnegative(np.array([[k] for k in gen_k]), np.array([f for f, _ in gen]))
    finally:
        torch.set_num_threads(threads)

    def ratio(pairs):
        return float(np.median([b / f for f, b in pairs if f > 0]))

    config = CostConfig(enc_linear_s=float(enc_fit.coef[0]), enc_quadratic_s=float(enc_fit.coef[1]),
                        bb_linear_s=float(bb_fit.coef[0]), bb_quadratic_s=float(bb_fit.coef[1]),
                        gen_per_image_s=float(gen_fit.coef[0]), enc_backward_factor=ratio(enc),
                        bb_backward_factor=ratio(bb), gen_backward_factor=ratio(gen))
    report = {
        "encoder": {"points": len(enc_t), "mean_rel_error": enc_fit.mean_rel_error,
                    "max_rel_error": enc_fit.max_rel_error},
        "backbone": {"points": len(bb_cases), "mean_rel_error": bb_fit.mean_rel_error,
                     "max_rel_error": bb_fit.max_rel_error},
        "generator": {"points": len(gen_k), "mean_rel_error": gen_fit.mean_rel_error,
                      "max_rel_error": gen_fit.max_rel_error},
    }
    log("module     coefficient                 fitted value   fit error on the timed points (forward)")
    rows = [("encoder", "enc_linear_s (per token)", config.enc_linear_s),
            ("", "enc_quadratic_s (per token^2)", config.enc_quadratic_s),
            ("", "enc_backward_factor", config.enc_backward_factor),
            ("backbone", "bb_linear_s (per token)", config.bb_linear_s),
            ("", "bb_quadratic_s (per doc len^2)", config.bb_quadratic_s),
            ("", "bb_backward_factor", config.bb_backward_factor),
            ("generator", "gen_per_image_s", config.gen_per_image_s),
            ("", "gen_backward_factor", config.gen_backward_factor)]
    for module, name, value in rows:
        err = report.get(module)
        note = (f"mean {err['mean_rel_error'] * 100:.1f}%, max {err['max_rel_error'] * 100:.1f}% over "
                f"{err['points']} sizes") if err else ""
        log(f"{module:<10} {name:<30} {value:12.4g}   {note}")
    return config, report


def save(config: CostConfig, path: Path) -> None:
    path.write_text(json.dumps(dataclasses.asdict(config), indent=1) + "\n")


def load(path: Path) -> CostConfig:
    """A CostConfig from the JSON ``calibrate`` writes; unknown keys are named."""
    data = json.loads(Path(path).read_text())
    known = {f.name for f in dataclasses.fields(CostConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path}: unknown cost coefficients {unknown}; known: {sorted(known)}")
    return CostConfig(**data)
