"""Per-sequence cost model: forward time of encoder, backbone and generator, from token counts only.

encoder   = sum over images of (enc_linear_s * t + enc_quadratic_s * t^2), t = image tokens
backbone  = bb_linear_s * n + bb_quadratic_s * sum over documents of len^2, n = non-padding tokens
generator = gen_per_image_s * images to generate
total     = sum over modules of forward * (1 + backward_factor); a frozen encoder has no backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from disttrain_api.config import CostConfig


@dataclass(frozen=True, slots=True)
class SequenceCost:
    """Forward seconds per module, and the fwd+bwd total the reorderers balance."""

    encoder_s: float
    backbone_s: float
    generator_s: float
    total_s: float


ZERO_COST = SequenceCost(0.0, 0.0, 0.0, 0.0)


def price_sequence(*, image_tokens: list[int], document_lengths: list[int], num_generated_images: int,
                   config: CostConfig) -> SequenceCost:
    """Cost of one packed sequence from its image token counts and document lengths."""
    encoder = sum(config.enc_linear_s * t + config.enc_quadratic_s * t * t for t in image_tokens)
    backbone = (config.bb_linear_s * sum(document_lengths)
                + config.bb_quadratic_s * sum(n * n for n in document_lengths))
    generator = config.gen_per_image_s * num_generated_images
    enc_bwd = 0.0 if config.enc_frozen else config.enc_backward_factor
    total = (encoder * (1.0 + enc_bwd) + backbone * (1.0 + config.bb_backward_factor)
             + generator * (1.0 + config.gen_backward_factor))
    return SequenceCost(encoder, backbone, generator, total)


@dataclass(frozen=True, slots=True)
class Fit:
    """Non-negative least-squares fit of seconds = features @ coef."""

    coef: np.ndarray
    mean_rel_error: float
    max_rel_error: float


def fit_nonnegative(features: np.ndarray, seconds: np.ndarray) -> Fit:
    """Least squares with coef >= 0 (by active set over the few columns), weighted to minimise the
    relative error, since timings span orders of magnitude."""
    features, seconds = np.asarray(features, float), np.asarray(seconds, float)
    w = 1.0 / seconds
    best = None
    cols = features.shape[1]
    for mask in range(1, 2 ** cols):
        active = [c for c in range(cols) if mask >> c & 1]
        sol, *_ = np.linalg.lstsq(features[:, active] * w[:, None], seconds * w, rcond=None)
        if (sol < 0).any():
            continue
        coef = np.zeros(cols)
        coef[active] = sol
        err = np.abs(features @ coef - seconds) / seconds
        if best is None or err.mean() < best.mean_rel_error:
            best = Fit(coef, float(err.mean()), float(err.max()))
    assert best is not None
    return best
