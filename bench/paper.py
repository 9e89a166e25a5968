"""SIMULATION: DistTrain's ablation ladder at paper scale, on LAION-like packed sequences.

    python bench/paper.py [--gpus 1152] [--global-batch 2304] [--batches 3] [--seqs-per-microbatch 1,2,4]
                          [--plot docs/paper-simulation.png] [--json FILE]
    python bench/paper.py --sweep [--plot docs/paper-simulation.png]   # which assumption decides the ratio
    python bench/paper.py --quick                                       # smoke run (the test's): 7B, A800

Nothing here is measured: GPUs, models and data are all simulated. What is real is the code that is
judged: sequences are packed by the service's packing rule (``core/packing.Packer``'s, see ``pack``),
priced by its cost model
(``core/cost.price_sequence``), planned by its batch planners (``core/reorder``) and timed by its
exact 1F1B simulator (``core/simulate``), on layouts chosen by the trainer's orchestration planner
(``trainer/orchestration/planner``). For each backbone (7B, 13B, 72B; ViT-H/14 encoder, SD-2.1
generator, as ``trainer/orchestration/simulate.py``) and accelerator (A800 as in the paper, H100),
on ``--gpus`` GPUs, it prints the ladder:

a. Megatron-LM: the fastest monolithic grid (``search_monolithic`` on the batch's mean sequence):
   encoder in the first pipeline stage, generator in the last, one DP x TP x PP for all, layers
   split evenly, sequences dealt to ranks and microbatches in arrival order;
b. + disaggregated orchestration, still in arrival order: the planner's search space, its best
   estimates re-ranked by the exact simulator (``checked_disaggregated``; the planner's own pick
   is printed beside it when they differ);
c. + intra-microbatch reordering (the paper's: ``INTRA_ALGORITHMS["paper"]``);
d. + inter-microbatch reordering (``INTER_ALGORITHMS["paper"]``, i.e. ``PLANNERS["paper"]``);
e. the service's default planner instead (``PLANNERS["ours"]``).

Beside the ladder, every batch planner on the same disaggregated layout (``COMPARED``: arrival,
random, the paper's intra step alone, the paper's two steps, lpt, ours), relative to arrival; and
all of it at each ``--seqs-per-microbatch`` S (sequences per rank per microbatch: at S = 1 the
paper's intra step has one sequence per rank in each slot, so only the loads it carries across
slots let it balance anything; see ``reorder.intra_paper``).

Iteration time = the exact simulator's slowest rank (or coupled component) + the gradient
all-reduce the planner assumes (``trainer.orchestration.simulate.grad_sync_s``, not overlapped).
Throughput in sequences/s and tokens/s (non-padding); MFU = model FLOPs (forward + backward of
every trained module, from the same FLOP counts) / (iteration x GPUs used x peak).

Data (``DataSpec``; every distribution is an assumption, sources as stated there): a mixture of
LAION-2B-style caption pairs (one image), text-to-image samples (caption -> one image to
generate, 64 query tokens) and OBELICS/MMC4-style interleaved documents (heavy-tailed image
count), image sizes from a LAION-like resolution distribution turned into tokens by the service's
image policy (patch 14, 2x2 merge, at most ``max_image_tokens`` per image), best-fit packed into
8192-token sequences (window 8). Per-sequence module seconds: the FlopProfile coefficients of each
module at its TP mapped onto the service's cost model (``FlopProfile.cost_coefficients`` ->
``CostConfig``), so a sequence costs ``price_sequence``'s formula (encoder: per image a t + b t^2;
backbone: per token + per squared document length; generator: per image).

``--sweep`` varies one assumption at a time (A800, all three backbones) and prints how far each
moves the ratio of the best rung to Megatron-LM; docs/paper-simulation.md has the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchjson, also when a test loads this file by path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchjson

from disttrain_api.config import CostConfig, ImageConfig
from disttrain_api.layout import StageModel
from preprocess_service.core import modalities, reorder
from preprocess_service.core.reorder.instance import PLANNERS, Instance, check_plan
from preprocess_service.core.sample import Document, GenImageRef, ImageRef, TextSegment
from preprocess_service.core.simulate import component_makespans
from trainer.orchestration.planner import (
    TP_SIZES,
    Parallel,
    Plan,
    Problem,
    disaggregated,
    monolithic,
    search_disaggregated,
    search_monolithic,
)
from trainer.orchestration.profile import A800, H100, Accelerator, Content, FlopProfile
from trainer.orchestration.simulate import BACKBONES, SD21, VIT_H, grad_sync_s, on

BENCH = Path(__file__).resolve().parent
PAPER = {
    "ratio": "up to 2.2x throughput over Megatron-LM",
    "mfu": "54.7% MFU, 72B multimodal LLM on 1,172 GPUs",
    "setup": "Llama-style backbone + ViT encoder + Stable Diffusion generator, LAION data, A800 GPUs",
}
"""The paper's headline figures (abstract of arXiv 2408.04275; setup as its SIGCOMM'25 talk states)."""

ACCELERATORS = {"A800": A800, "H100": H100}
P2P_LATENCY_S = 20e-6
"""Pipeline send latency the planner assumes; the exact simulation adds the activation transfer."""

# -- data -----------------------------------------------------------------------------------------

ENC_T, ENC_T2, TOKENS, LEN2, GEN = range(5)
"""Columns of a batch's features, float[B, 5]: per sequence, the sum of image tokens, the sum of
squared image tokens, non-padding tokens, the sum of squared document lengths, images to generate
(what ``core/cost.price_sequence`` reads)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DataSpec:
    """A LAION-like sample mixture. Sources and what is assumed:

    * kinds: LAION-2B(-en) is one image and its alt-text per sample (Schuhmann et al., LAION-5B,
      NeurIPS 2022); interleaved web documents (OBELICS: 141M documents, 353M images, 115B text
      tokens, i.e. ~2.5 images and ~800 tokens per document, Laurencon et al. 2023; MMC4 ~5.7
      images per document, Zhu et al. 2023) have a heavy-tailed image count. The shares are ours.
    * image count of an interleaved document: 1 + NegativeBinomial(0.5, p) with mean
      ``interleaved_images`` (heavy tail), at most 30; text: lognormal, median 500 tokens.
    * resolution: shorter side lognormal, median 290 px, sigma 0.71, so ~57% of images have a
      shorter side >= 256 px, ~21% >= 512 and ~4% >= 1024 (LAION-5B's high-resolution subset is
      170M of 5.85B images >= 1024 px, ~3%; the other two quantiles are our assumption); aspect
      ratio exp(|N(0, 0.35)|), 60% landscape. Tokens by the service's image policy (ImageConfig:
      patch 14, 2x2 merge, Qwen2-VL-style resize) capped at ``max_image_tokens``.
    * caption: lognormal, median 10 words (sigma 0.6: mean ~12, long tail), 1.3 tokens per word,
      at most 256 tokens; LAION alt-texts are short, ~10-15 words on average.
    * generation: ``gen_share`` of the samples are text-to-image (caption -> one image at
      ``gen_size`` px, 64 query tokens in the sequence, no encoder image).
    * ``spread`` scales every lognormal sigma (0: fixed sizes, only the mixture varies);
      ``homogeneous`` replaces every sequence by the batch mean (no data heterogeneity at all).
    """

    seq_len: int = 8192
    interleaved_share: float = 0.2
    gen_share: float = 0.25
    interleaved_images: float = 2.5
    max_image_tokens: int = 1024
    gen_size: int = 512
    gen_query_tokens: int = 64
    spread: float = 1.0
    homogeneous: bool = False
    pack_window: int = 8


def _image_tokens(short: np.ndarray, aspect: np.ndarray, landscape: np.ndarray, spec: DataSpec) -> np.ndarray:
    """The service's resize rule (adapters/imaging.target_size, vectorised) -> tokens per image."""
    config = ImageConfig(max_pixels=spec.max_image_tokens * 28 * 28)
    f = config.factor
    height = np.where(landscape, short, short * aspect)
    width = np.where(landscape, short * aspect, short)
    h = np.maximum(f, np.round(height / f) * f)
    w = np.maximum(f, np.round(width / f) * f)
    big, small = h * w > config.max_pixels, h * w < config.min_pixels
    beta = np.sqrt(height * width / config.max_pixels)
    h = np.where(big, np.maximum(f, np.floor(height / beta / f) * f), h)
    w = np.where(big, np.maximum(f, np.floor(width / beta / f) * f), w)
    beta = np.sqrt(config.min_pixels / (height * width))
    h = np.where(small, np.ceil(height * beta / f) * f, h)
    w = np.where(small, np.ceil(width * beta / f) * f, w)
    return ((h // f) * (w // f)).astype(np.int64)


def sample_images(rng: np.random.Generator, n: int, spec: DataSpec) -> np.ndarray:
    """int[n]: encoder tokens of n LAION-like images."""
    short = np.exp(rng.normal(math.log(290), 0.71 * spec.spread, n)).clip(28, 8000)
    aspect = np.exp(np.abs(rng.normal(0.0, 0.35 * spec.spread, n))).clip(1.0, 4.0)
    return _image_tokens(short, aspect, rng.random(n) < 0.6, spec)


def sample_documents(rng: np.random.Generator, n: int, spec: DataSpec, start: int = 0) -> list[Document]:
    """n documents of the mixture (DataSpec), keys ``doc-{start + i}``."""
    kind = rng.choice(3, size=n, p=[1 - spec.interleaved_share - spec.gen_share, spec.gen_share,
                                    spec.interleaved_share])
    words = np.exp(rng.normal(math.log(10), 0.6 * spec.spread, n))
    caption = np.clip(np.round(1.3 * words), 1, 256).astype(int)
    dispersion = 0.5
    p = dispersion / (dispersion + spec.interleaved_images - 1)
    counts = np.where(kind == 2, np.minimum(30, 1 + rng.negative_binomial(dispersion, p, n)), kind == 0)
    images = sample_images(rng, int(counts.sum()), spec)
    text = np.where(kind == 2, np.exp(rng.normal(math.log(500), 0.9 * spec.spread, n)).astype(int) + 1, caption)
    docs, cursor = [], 0
    for i in range(n):
        own = images[cursor:cursor + counts[i]].tolist()
        cursor += counts[i]
        budget = spec.seq_len - 2 - (spec.gen_query_tokens if kind[i] == 1 else 0)
        while own and sum(own) + 1 > budget:  # an interleaved document longer than a sequence: cut
            own.pop()
        segments: list = [TextSegment("txt", np.empty(min(int(text[i]), budget - sum(own)), np.int32))]
        segments += [ImageRef(f"{j}.jpg", 0, 0, t) for j, t in enumerate(own)]
        if kind[i] == 1:
            segments.append(GenImageRef("gen.jpg", spec.gen_size, spec.gen_query_tokens))
        docs.append(Document(key=f"doc-{start + i}", shard="laion-like", segments=tuple(segments)))
    return docs


def sequence_features(docs: list[Document]) -> np.ndarray:
    """float[5] of one packed sequence (columns ENC_T .. GEN)."""
    image = [t for d in docs for t in modalities.encoder_tokens(d)]
    lengths = [d.num_tokens for d in docs]
    return np.array([sum(image), sum(t * t for t in image), sum(lengths), sum(n * n for n in lengths),
                     sum(len(d.generated) for d in docs)], dtype=float)


def pack(docs: list[Document], seq_len: int, window: int, open_seqs: list | None = None) -> list[list[Document]]:
    """The service's Packer rule (core/packing.Packer: best fit over ``window`` open sequences, the
    fullest emitted when none fits) on token counts computed once: Packer recomputes them on every
    add, too slow for a paper-scale batch. The test checks both emit the same sequences.
    ``open_seqs`` ([free tokens, documents] pairs) carries the open sequences across calls."""
    open_seqs = [] if open_seqs is None else open_seqs
    emitted = []
    for doc in docs:
        n = doc.num_tokens
        if n > seq_len:
            raise ValueError(f"document {doc.key!r} has {n} tokens, more than seq_len {seq_len}")
        target = None
        for entry in open_seqs:
            if entry[0] >= n and (target is None or entry[0] < target[0]):
                target = entry
        if target is None:
            if len(open_seqs) >= window:
                fullest = min(open_seqs, key=lambda e: e[0])
                open_seqs.remove(fullest)
                emitted.append(fullest[1])
            target = [seq_len, []]
            open_seqs.append(target)
        target[0] -= n
        target[1].append(doc)
        if target[0] == 0:
            open_seqs.remove(target)
            emitted.append(target[1])
    return emitted


def make_batches(spec: DataSpec, num_batches: int, global_batch: int, seed: int = 0) -> list[np.ndarray]:
    """``num_batches`` x float[global_batch, 5]: features of LAION-like sequences, packed by the
    service's rule (``pack``), in emission (arrival) order; seeded, deterministic."""
    rng = np.random.default_rng([seed, 18])
    features: list[np.ndarray] = []
    open_seqs: list = []
    made = 0
    while len(features) < num_batches * global_batch:
        docs = sample_documents(rng, 4096, spec, made)
        made += len(docs)
        features += [sequence_features(seq) for seq in pack(docs, spec.seq_len, spec.pack_window, open_seqs)]
    batches = [np.array(features[i * global_batch:(i + 1) * global_batch]) for i in range(num_batches)]
    if spec.homogeneous:
        batches = [np.broadcast_to(b.mean(axis=0), b.shape).copy() for b in batches]
    return batches


# -- models and prices ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """Everything one ladder depends on besides the data; ``--sweep`` varies one field at a time."""

    backbone: str = "7B"
    accelerator: str = "A800"
    gpus: int = 1152
    global_batch: int = 2304
    seqs_per_microbatch: int = 1
    encoder: FlopProfile = VIT_H
    generator: FlopProfile = SD21
    frozen: bool = False
    """Encoder and generator frozen: no backward, no gradients (the backbone still trains)."""
    megatron_grid: str = "search"
    """"search": fastest monolithic grid; "pipelined": fastest with PP >= 2; "pp<N>": fastest with
    N stages; "distrain": the disaggregated plan's backbone TP and PP, with as many DP ranks as fit."""
    megatron_split: str = "even"
    """Backbone layers over Megatron's stages: "even", or "balanced" (fewer layers where the
    encoder and generator sit, chosen on the mean sequence)."""
    megatron_enc_tp: str = "backbone"
    """Megatron's encoder and generator at the backbone's TP ("backbone"), or replicated inside the
    TP group, each TP rank taking 1/TP of the images ("replicated")."""
    sync: float = 1.0
    """Share of the gradient all-reduce that is exposed (1: none overlapped, the planner's model)."""
    memory_gb: float = 0.0
    """GPU memory the planner may fill (0: the accelerator's)."""

    def device(self) -> Accelerator:
        acc = ACCELERATORS[self.accelerator]
        return dataclasses.replace(acc, memory_bytes=self.memory_gb * 1e9) if self.memory_gb else acc

    def modules(self) -> tuple[FlopProfile, FlopProfile, FlopProfile, int]:
        acc = self.device()
        backbone, layers = BACKBONES[self.backbone]
        enc, gen = self.encoder, self.generator
        if self.frozen:
            enc, gen = dataclasses.replace(enc, bwd_factor=0.0), dataclasses.replace(gen, bwd_factor=0.0)
        return on(enc, acc), on(backbone, acc), on(gen, acc), layers


def cost_config(enc: FlopProfile, bb: FlopProfile, gen: FlopProfile, tp: tuple[int, int, int]) -> CostConfig:
    """The service's cost model with each module's FLOP-derived coefficients at its TP."""
    (el, eq), (bl, bq) = enc.cost_coefficients(tp[0]), bb.cost_coefficients(tp[1])
    gl, _ = gen.cost_coefficients(tp[2])
    return CostConfig(enc_linear_s=el, enc_quadratic_s=eq, bb_linear_s=bl, bb_quadratic_s=bq, gen_per_image_s=gl,
                      enc_backward_factor=enc.bwd_factor, bb_backward_factor=bb.bwd_factor,
                      gen_backward_factor=gen.bwd_factor)


def module_seconds(features: np.ndarray, config: CostConfig) -> np.ndarray:
    """float[B, 3]: forward seconds of enc, bb, gen per sequence, ``price_sequence``'s formula on
    the feature columns (the test checks it against price_sequence on packed sequences)."""
    return np.column_stack([
        config.enc_linear_s * features[:, ENC_T] + config.enc_quadratic_s * features[:, ENC_T2],
        config.bb_linear_s * features[:, TOKENS] + config.bb_quadratic_s * features[:, LEN2],
        config.gen_per_image_s * features[:, GEN]])


def model_flops(features: np.ndarray, enc: FlopProfile, bb: FlopProfile, gen: FlopProfile) -> np.ndarray:
    """float[3]: forward + backward model FLOPs of a batch in enc, bb, gen (a frozen module: forward only)."""
    out = np.zeros(3)
    for i, (profile, cols) in enumerate(((enc, (ENC_T, ENC_T2)), (bb, (TOKENS, LEN2)), (gen, (GEN, GEN)))):
        linear, quadratic = profile.flop_coefficients()
        work = linear * features[:, cols[0]].sum() + (quadratic * features[:, cols[1]].sum() if quadratic else 0.0)
        out[i] = (1 + profile.bwd_factor) * work
    return out


def mean_content(features: np.ndarray, S: int) -> Content:
    """One microbatch of S mean sequences, as the orchestration planner takes it."""
    f = features.sum(axis=0)
    n = len(features)
    return Content(tokens=round(S * f[TOKENS] / n), image_tokens=round(S * f[ENC_T] / n), gen_images=S * f[GEN] / n,
                   doc_len=round(f[LEN2] / f[TOKENS]), image_len=f[ENC_T2] / max(f[ENC_T], 1.0))


# -- layouts --------------------------------------------------------------------------------------


def problem_for(scenario: Scenario, content: Content) -> Problem:
    enc, bb, gen, layers = scenario.modules()
    return Problem(encoder=enc, backbone=bb, generator=gen, content=content, global_batch=scenario.global_batch,
                   seqs_per_microbatch=scenario.seqs_per_microbatch, num_gpus=scenario.gpus,
                   accelerator=scenario.device(), backbone_layers=layers, p2p_s=P2P_LATENCY_S)


@functools.lru_cache(maxsize=512)
def _search_disaggregated(problem: Problem) -> Plan | None:
    """The planner's search, once per problem (a sweep and the tests meet the same problem often)."""
    return search_disaggregated(problem)


@functools.lru_cache(maxsize=512)
def _search_monolithic(problem: Problem) -> Plan | None:
    return search_monolithic(problem)


@functools.lru_cache(maxsize=512)
def _checked_disaggregated(problem: Problem, scenario: Scenario, mean: tuple[float, ...]) -> Plan | None:
    return checked_disaggregated(problem, scenario, np.array(mean))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def megatron_plan(problem: Problem, scenario: Scenario, dis: Plan) -> Plan | None:
    """Megatron-LM's grid (Scenario.megatron_grid)."""
    if scenario.megatron_grid == "search":
        return _search_monolithic(problem)
    sequences = problem.global_batch // problem.seqs_per_microbatch
    if scenario.megatron_grid == "distrain":
        tp, pp = dis.bb.tp, dis.bb.pp
        grids = [Parallel(dp, tp, pp) for dp in _divisors(sequences)]
    elif scenario.megatron_grid == "pipelined" or scenario.megatron_grid.startswith("pp"):
        depths = (_divisors(problem.backbone_layers)[1:] if scenario.megatron_grid == "pipelined"
                  else [int(scenario.megatron_grid[2:])])
        grids = [Parallel(dp, tp, pp) for tp in TP_SIZES for pp in depths for dp in _divisors(sequences)]
    else:
        raise ValueError("megatron_grid must be 'search', 'pipelined', 'pp<N>' or 'distrain', got "
                         f"{scenario.megatron_grid!r}")
    plans = [p for p in (monolithic(problem, g) for g in grids) if p is not None]
    return min(plans, key=lambda p: p.iteration_s, default=None)


CHECKED_CANDIDATES = 40
"""Disaggregated layouts (the planner's best estimates) that the exact simulator re-ranks."""


def checked_disaggregated(problem: Problem, scenario: Scenario, mean_features: np.ndarray) -> Plan | None:
    """The planner's search space (every backbone grid and encoder/generator TP; the replica counts
    next to the planner's balanced split, with and without several replicas per backbone rank),
    its CHECKED_CANDIDATES best estimates re-ranked by the exact simulator on the mean sequence.
    The planner prices a stage with k replicas per rank as 1/k of one; the exact 1F1B simulator
    runs each replica's share of the stage's op order, which can be far slower."""
    c = problem.content
    sequences = problem.global_batch // problem.seqs_per_microbatch
    enc_s = {tp: problem.encoder.fwd_s(c, tp) + problem.encoder.bwd_s(c, tp) for tp in TP_SIZES}
    gen_s = {tp: problem.generator.fwd_s(c, tp) + problem.generator.bwd_s(c, tp) for tp in TP_SIZES}
    grids = [Parallel(dp, tp, pp) for tp in TP_SIZES for pp in _divisors(problem.backbone_layers)
             for dp in _divisors(sequences) if problem.num_gpus - dp * tp * pp >= 2]

    def floor_s(bb: Parallel) -> float:  # the backbone alone: no estimate with this grid is lower
        stage = problem.backbone.fwd_s(c, bb.tp, 1 / bb.pp) + problem.backbone.bwd_s(c, bb.tp, 1 / bb.pp)
        return (sequences // bb.dp + bb.pp - 1) * stage

    plans: list[Plan] = []
    for bb in sorted(grids, key=floor_s):
        if len(plans) >= CHECKED_CANDIDATES:
            plans = sorted(plans, key=lambda p: p.iteration_s)[:CHECKED_CANDIDATES]
            if floor_s(bb) > plans[-1].iteration_s:
                break
        left = problem.num_gpus - bb.gpus
        for enc_tp, gen_tp in ((e, g) for e in TP_SIZES for g in TP_SIZES):
            a, b = enc_s[enc_tp], gen_s[gen_tp]
            ideal = left * a / (a * enc_tp + b * gen_tp)
            for replicas in (_divisors(bb.dp), _divisors(bb.dp) + [bb.dp * k for k in range(2, left // bb.dp + 1)]):
                below = [r for r in replicas if r <= ideal]
                for enc_dp in {below[-1] if below else 1, next((r for r in replicas if r >= ideal), bb.dp)}:
                    fits = [r for r in replicas if r * gen_tp <= left - enc_dp * enc_tp]
                    plan = fits and disaggregated(problem, Parallel(enc_dp, enc_tp), bb, Parallel(fits[-1], gen_tp))
                    if plan and runnable(plan):
                        plans.append(plan)
    plans.sort(key=lambda p: p.iteration_s)
    return min(plans[:CHECKED_CANDIDATES], key=lambda p: mean_sequence_s(p, problem, scenario, mean_features),
               default=None)


def runnable(plan: Plan) -> bool:
    """Whether the runtime can run the plan (disttrain_api.layout.PipelineLayout accepts it)."""
    try:
        plan.layout()
    except ValueError:
        return False
    return True


def mean_sequence_s(plan: Plan, problem: Problem, scenario: Scenario, mean_features: np.ndarray) -> float:
    """Exact simulated iteration of ``plan`` when every sequence is the mean one (nan: not runnable)."""
    if not runnable(plan):
        return math.nan
    layout = simulable(plan, problem, scenario, mean_features)
    costs = np.repeat(layout.seconds(mean_features[None]), problem.global_batch, axis=0)
    instance = layout.instance(costs)
    return layout.iteration_s(costs, PLANNERS["arrival"](instance, np.random.default_rng(0)))


def balanced_layers(layers: int, pp: int, mean_fwd: np.ndarray) -> list[int]:
    """Backbone layers per stage that minimise the slowest stage of the mean sequence when the
    encoder sits in the first stage and the generator in the last (mean_fwd: enc, bb, gen)."""
    counts = [layers // pp] * pp
    extra = [mean_fwd[0]] + [0.0] * (pp - 2) + [mean_fwd[2]] if pp > 1 else [mean_fwd[0] + mean_fwd[2]]

    def stage(s: int, c: int) -> float:
        return c / layers * mean_fwd[1] + extra[s]

    while True:
        slow = max(range(pp), key=lambda s: stage(s, counts[s]))
        fast = min(range(pp), key=lambda s: stage(s, counts[s] + 1))
        if counts[slow] == 0 or stage(fast, counts[fast] + 1) >= stage(slow, counts[slow]):
            return counts
        counts[slow] -= 1
        counts[fast] += 1


@dataclass(slots=True)
class Layout:
    """A plan made simulable: the service's stage model of it and how its sequences are priced."""

    plan: Plan
    model: StageModel
    config: CostConfig
    weights: np.ndarray
    """float[P, 3]: share of each module's time per stage (``model.weights()`` unless rebalanced)."""
    sync_s: float
    enc_gen_divisor: float = 1.0
    """Megatron with a replicated encoder/generator: each TP rank runs 1/TP of their work at TP 1."""

    def seconds(self, features: np.ndarray) -> np.ndarray:
        costs = module_seconds(features, self.config)
        costs[:, [0, 2]] /= self.enc_gen_divisor
        return costs

    def instance(self, costs: np.ndarray) -> Instance:
        return Instance(D=self.plan.bb.dp, M=self.plan.num_microbatches, S=len(costs) // (self.plan.bb.dp *
                        self.plan.num_microbatches), model=self.model, costs=costs)

    def iteration_s(self, costs: np.ndarray, assignment: np.ndarray) -> float:
        """Slowest rank (or coupled component) by the exact 1F1B simulator + gradient sync; with
        ``model.weights()`` this is ``instance.evaluate``'s iteration time + sync."""
        bwd = np.asarray(self.model.bwd_factor)
        seq_fwd, seq_bwd = self.weights @ costs.T, self.weights @ (costs * bwd).T  # [P, B]
        fwd = seq_fwd[:, assignment].sum(axis=-1).transpose(1, 0, 2)
        back = seq_bwd[:, assignment].sum(axis=-1).transpose(1, 0, 2)
        return float(component_makespans(fwd, back, self.model).max()) + self.sync_s


def simulable(plan: Plan, problem: Problem, scenario: Scenario, mean_features: np.ndarray) -> Layout:
    enc, bb, gen, _ = scenario.modules()
    mono = plan.kind == "monolithic"
    replicated = mono and scenario.megatron_enc_tp == "replicated"
    tp = (1, plan.bb.tp, 1) if replicated else (plan.bb.tp,) * 3 if mono else (plan.enc.tp, plan.bb.tp, plan.gen.tp)
    config = cost_config(enc, bb, gen, tp)
    activations = scenario.seqs_per_microbatch * (mean_features[TOKENS] * bb.hidden * 2) / plan.bb.tp
    p2p = P2P_LATENCY_S + activations / problem.accelerator.dp_link_bytes_s
    model = plan.layout().stage_model((enc.bwd_factor, bb.bwd_factor, gen.bwd_factor), p2p)
    layout = Layout(plan, model, config, model.weights(), scenario.sync * grad_sync_s(problem, plan),
                    plan.bb.tp if replicated else 1.0)
    if mono and scenario.megatron_split == "balanced" and plan.bb.pp > 1:
        mean = layout.seconds(mean_features[None])[0]
        counts = balanced_layers(problem.backbone_layers, plan.bb.pp, mean)
        layout.weights[:, 1] = np.array(counts) / problem.backbone_layers
    elif scenario.megatron_split not in ("even", "balanced"):
        raise ValueError(f"megatron_split must be 'even' or 'balanced', got {scenario.megatron_split!r}")
    return layout


# -- the ladder -----------------------------------------------------------------------------------

BatchPlanner = Callable[[Instance, np.random.Generator], np.ndarray]


def _intra_only(intra: str) -> BatchPlanner:
    def plan(instance: Instance, rng: np.random.Generator) -> np.ndarray:
        return reorder.plan_batch(instance.totals, D=instance.D, M=instance.M, S=instance.S, intra=intra,
                                  inter="arrival", rng=rng)
    return plan


PAPER_INTRA = _intra_only("paper")
"""The paper's intra-microbatch step alone, microbatches in arrival order."""


@dataclass(frozen=True, slots=True)
class Rung:
    key: str
    label: str
    layout: str
    """"monolithic" or "disaggregated"."""
    planner: BatchPlanner


RUNGS: tuple[Rung, ...] = (
    Rung("megatron", "a. Megatron-LM (monolithic, arrival)", "monolithic", PLANNERS["arrival"]),
    Rung("disagg", "b. + disaggregated orchestration", "disaggregated", PLANNERS["arrival"]),
    Rung("intra", "c. + intra-microbatch reorder (paper)", "disaggregated", PAPER_INTRA),
    Rung("inter", "d. + inter-microbatch reorder (paper)", "disaggregated", PLANNERS["paper"]),
    Rung("ours", "e. service planner 'ours' for c+d", "disaggregated", PLANNERS["ours"]),
)
"""The ablation ladder, in the order printed: each rung adds one technique to the one above;
``ours`` replaces the paper's two reorderings by the service's default planner."""

COMPARED: tuple[Rung, ...] = (
    Rung("arrival", "arrival (no reordering)", "disaggregated", PLANNERS["arrival"]),
    Rung("random", "random", "disaggregated", PLANNERS["random"]),
    Rung("paper-intra", "paper, intra step alone", "disaggregated", PAPER_INTRA),
    Rung("paper", "paper (intra + inter)", "disaggregated", PLANNERS["paper"]),
    Rung("lpt", "lpt + paper's inter", "disaggregated", PLANNERS["lpt"]),
    Rung("ours", "ours", "disaggregated", PLANNERS["ours"]),
)
"""Every batch planner on the ladder's disaggregated layout, side by side (``Ladder.compared``)."""


class NoLayout(ValueError):
    """No disaggregated layout of the scenario fits its GPUs."""


@dataclass(slots=True)
class Ladder:
    scenario: Scenario
    plans: dict[str, Plan | None]
    """"monolithic" (Megatron-LM's grid) and "disaggregated" (checked_disaggregated's pick)."""
    planner_pick: Plan | None
    """search_disaggregated's own pick, by its estimate alone (None: not compared)."""
    mean_s: dict[str, float]
    """Exact simulated iteration on the mean sequence of the two plans and the planner's pick."""
    flop_share: np.ndarray
    """float[3]: share of the model FLOPs in enc, bb, gen."""
    rows: list[dict] = field(default_factory=list)
    compared: list[dict] = field(default_factory=list)
    """COMPARED's planners on the disaggregated layout: rung, label, iteration_s, x_arrival."""

    def row(self, key: str) -> dict:
        return next(r for r in self.rows if r["rung"] == key)

    def best_ratio(self) -> float:
        """Fastest disaggregated rung / Megatron-LM (nan when no Megatron-LM grid fits)."""
        values = [r["x_megatron"] for r in self.rows if r["rung"] != "megatron"]
        return math.nan if any(math.isnan(v) for v in values) else max(values)


def run_ladder(scenario: Scenario, batches: list[np.ndarray], rungs: tuple[Rung, ...] = RUNGS,
               seed: int = 0, compare_pick: bool = True, compared: tuple[Rung, ...] = COMPARED) -> Ladder:
    """Every rung on every batch; throughput and MFU from the mean iteration time. ``compare_pick``:
    also run the planner's own search, to show its pick beside the checked one. ``compared``: the
    planners side by side on the disaggregated layout (a planner a rung ran is not run again;
    ``compared[0]`` is the one the others are relative to)."""
    everything = np.concatenate(batches)
    problem = problem_for(scenario, mean_content(everything, scenario.seqs_per_microbatch))
    mean = everything.mean(axis=0)
    dis = _checked_disaggregated(problem, scenario, tuple(mean))
    if dis is None:
        raise NoLayout(f"no disaggregated layout of {scenario.backbone} fits {scenario.gpus} GPUs")
    mean_s = {"disaggregated": mean_sequence_s(dis, problem, scenario, mean)}
    pick = _search_disaggregated(problem) if compare_pick else None
    if pick is not None:
        mean_s["planner"] = mean_sequence_s(pick, problem, scenario, mean)
        if mean_s["planner"] < mean_s["disaggregated"]:  # a candidate the enumeration missed: keep the faster
            dis, mean_s["disaggregated"] = pick, mean_s["planner"]
        pick = dis if pick.describe() == dis.describe() else pick
    mono = megatron_plan(problem, scenario, dis)  # None: no grid of that kind fits in memory
    if mono is not None:
        mean_s["monolithic"] = mean_sequence_s(mono, problem, scenario, mean)
    plans = {"monolithic": mono, "disaggregated": dis}
    enc, bb, gen, _ = scenario.modules()
    flops = np.mean([model_flops(b, enc, bb, gen) for b in batches], axis=0)
    ladder = Ladder(scenario, plans, pick, mean_s, flops / flops.sum())
    layouts = {k: simulable(p, problem, scenario, mean) for k, p in plans.items() if p}
    costs = {k: [lay.seconds(b) for b in batches] for k, lay in layouts.items()}
    flops = flops.sum()
    tokens = np.mean([b[:, TOKENS].sum() for b in batches])
    peak = problem.accelerator.peak_flops
    def mean_iteration(rung: Rung) -> tuple[float, int]:
        layout = layouts.get(rung.layout)
        if layout is None:
            return math.nan, 0
        times = []
        for i, batch_costs in enumerate(costs[rung.layout]):
            instance = layout.instance(batch_costs)
            plan = check_plan(instance, rung.planner(instance, np.random.default_rng([seed, i])))
            times.append(layout.iteration_s(batch_costs, plan))
        return float(np.mean(times)), layout.plan.gpus

    done: dict[tuple[str, BatchPlanner], float] = {}
    for rung in rungs:
        iteration, gpus = mean_iteration(rung)
        done[(rung.layout, rung.planner)] = iteration
        ladder.rows.append({"rung": rung.key, "label": rung.label, "iteration_s": iteration, "gpus": gpus,
                            "seq_s": scenario.global_batch / iteration, "tokens_s": tokens / iteration,
                            "mfu": flops / (iteration * gpus * peak) if gpus else math.nan})
    for rung in compared:
        iteration = done.get((rung.layout, rung.planner))
        if iteration is None:
            iteration = mean_iteration(rung)[0]
        ladder.compared.append({"rung": rung.key, "label": rung.label, "iteration_s": iteration})
    for row in ladder.compared:
        row["x_arrival"] = row["iteration_s"] / ladder.compared[0]["iteration_s"]
    base = ladder.rows[0]["seq_s"]
    for i, row in enumerate(ladder.rows):
        row["x_megatron"] = row["seq_s"] / base
        row["x_previous"] = row["seq_s"] / ladder.rows[i - 1]["seq_s"] if i else 1.0
    return ladder


# -- output ---------------------------------------------------------------------------------------


def print_ladder(ladder: Ladder) -> None:
    sc = ladder.scenario
    mono, dis = ladder.plans["monolithic"], ladder.plans["disaggregated"]
    assert dis is not None, "run_ladder always finds a disaggregated layout"
    print(f"\n{sc.backbone} backbone on {sc.gpus} simulated {sc.accelerator}, global batch {sc.global_batch} x "
          f"{DataSpec().seq_len} tokens, S={sc.seqs_per_microbatch} sequences per microbatch")
    def estimates(plan: Plan, key: str) -> str:
        exact = ladder.mean_s[key]
        return (f"M={plan.num_microbatches}, planner estimate {plan.iteration_s:.2f} s, " +
                ("not a runnable PipelineLayout" if math.isnan(exact) else f"exact on the mean sequence {exact:.2f} s"))

    print(f"  Megatron-LM grid: {mono.describe() + ', ' + estimates(mono, 'monolithic') if mono else 'none fits'}")
    print(f"  disaggregated:    {dis.describe()}, {estimates(dis, 'disaggregated')}")
    if ladder.planner_pick is not None and ladder.planner_pick is not dis:
        print(f"  (planner's pick:  {ladder.planner_pick.describe()}, {estimates(ladder.planner_pick, 'planner')})")
    gpus = np.array([dis.enc.gpus, dis.bb.gpus, dis.gen.gpus]) / dis.gpus
    print("  enc / bb / gen:   GPUs " + " / ".join(f"{g:.0%}" for g in gpus) + " of the disaggregated layout, "
          "model FLOPs " + " / ".join(f"{f:.0%}" for f in ladder.flop_share))
    print(f"  {'rung':40s} {'iter s':>8s} {'seq/s':>8s} {'Mtok/s':>7s} {'MFU':>6s} {'GPUs':>5s} "
          f"{'x Megatron':>10s} {'x prev':>7s}")
    for r in ladder.rows:
        print(f"  {r['label']:40s} {r['iteration_s']:8.2f} {r['seq_s']:8.1f} {r['tokens_s'] / 1e6:7.2f} "
              f"{r['mfu']:6.1%} {r['gpus']:5d} {r['x_megatron']:9.2f}x {r['x_previous']:6.2f}x")
    print("  planners on the disaggregated layout, iteration / arrival's: " +
          ", ".join(f"{r['rung']} {r['x_arrival']:.3f}" for r in ladder.compared[1:]))


def print_summary(ladders: list[Ladder]) -> None:
    print("\nsummary (SIMULATION) next to the paper's figures:")
    print(f"  paper: {PAPER['ratio']}; {PAPER['mfu']}; setup: {PAPER['setup']}")
    for ladder in ladders:
        sc, best = ladder.scenario, max(ladder.rows[1:], key=lambda r: r["x_megatron"])
        print(f"  here:  {sc.backbone:>3s} {sc.accelerator} S={sc.seqs_per_microbatch}: best rung "
              f"{best['rung']:6s} {best['x_megatron']:.2f}x Megatron-LM, MFU {best['mfu']:.1%} "
              f"(Megatron-LM {ladder.rows[0]['mfu']:.1%})")
    print("\nplanners on the disaggregated layout (SIMULATION), iteration / arrival's; last column ours / paper:")
    table = planners_table(ladders)
    print("  " + " ".join(f"{c:>11s}" for c in table["columns"]))
    for row in table["rows"]:
        print("  " + " ".join(f"{v:>11}" if isinstance(v, str | int) else f"{v:11.3f}" for v in row))


def ladder_table(ladders: list[Ladder]) -> dict:
    """The ladders as one table: throughput / Megatron-LM's per rung, and MFU at both ends."""
    columns = ["GPU", "backbone", "S", *(r.key for r in RUNGS), "MFU megatron", "MFU ours"]
    rows = [[lad.scenario.accelerator, lad.scenario.backbone, lad.scenario.seqs_per_microbatch,
             *(lad.row(r.key)["x_megatron"] for r in RUNGS), lad.row("megatron")["mfu"], lad.row("ours")["mfu"]]
            for lad in ladders]
    return benchjson.table("SIMULATION: ablation ladder, throughput / Megatron-LM's", columns, rows,
                           notes=["nothing is measured: simulated GPUs, models and data (see bench/paper.py)"])


def planners_table(ladders: list[Ladder]) -> dict:
    """Every COMPARED planner's iteration over arrival's, per ladder, and ours / paper."""
    keys = [r["rung"] for r in ladders[0].compared[1:]] if ladders else []
    columns = ["GPU", "backbone", "S", *keys, "ours/paper"]
    rows = []
    for lad in ladders:
        x = {r["rung"]: r["x_arrival"] for r in lad.compared}
        rows.append([lad.scenario.accelerator, lad.scenario.backbone, lad.scenario.seqs_per_microbatch,
                     *(x[k] for k in keys), x["ours"] / x["paper"]])
    return benchjson.table("SIMULATION: batch planners on the disaggregated layout, iteration / arrival's", columns,
                           rows, notes=["S: sequences per rank per microbatch; < 1: faster than no reordering"])


def ladder_json(ladder: Ladder) -> dict:
    plans = {k: (p.describe() if p else None) for k, p in ladder.plans.items()}
    scenario = {f.name: getattr(ladder.scenario, f.name) for f in dataclasses.fields(ladder.scenario)}
    scenario["encoder"], scenario["generator"] = scenario["encoder"].name, scenario["generator"].name
    return {"scenario": scenario, "plans": plans, "rows": ladder.rows, "compared": ladder.compared}


# -- the sweep ------------------------------------------------------------------------------------

VIT_6B = FlopProfile("InternViT-6B-like (5.9B, 45 x 3200)", params=5.9e9, layers=45, hidden=3200, accelerator=H100,
                     work_per="image_token", patches_per_token=4)
SD21_768 = dataclasses.replace(SD21, name="SD-2.1 UNet at 768 px", work_per_gen_image=462.0 * 2.25)
SDXL = FlopProfile("SDXL UNet at 1024 px (2.6B, ~6 TFLOP/image)", params=2.6e9, layers=0, hidden=0, accelerator=H100,
                   work_per="gen_image", work_per_gen_image=1150.0)
PP8 = {"megatron_grid": "pp8"}

SWEEP: tuple[tuple[str, tuple[tuple[str, dict, dict], ...]], ...] = (
    ("Megatron pipeline depth", (("fastest grid*", {}, {}),
                                 *((f"PP={pp}", {"megatron_grid": f"pp{pp}"}, {}) for pp in (2, 4, 8, 16)),
                                 ("DistTrain's backbone TP/PP", {"megatron_grid": "distrain"}, {}))),
    ("Megatron layer split (at PP=8)", (("even*", PP8, {}), ("balanced", {**PP8, "megatron_split": "balanced"}, {}))),
    ("Megatron encoder/generator TP", (("backbone's TP*", {}, {}), ("replicated in TP group",
                                                                   {"megatron_enc_tp": "replicated"}, {}))),
    ("encoder", (("ViT-H/14 0.63B*", {}, {}), ("ViT 5.9B", {"encoder": VIT_6B}, {}))),
    ("generator", (("SD-2.1 512px*", {}, {}), ("SD-2.1 768px", {"generator": SD21_768}, {}),
                   ("SDXL 1024px", {"generator": SDXL}, {}))),
    ("tokens per image (cap)", (("256", {}, {"max_image_tokens": 256}), ("1024*", {}, {}),
                                ("4096", {}, {"max_image_tokens": 4096}))),
    ("heterogeneity", (("none (batch mean)", {}, {"homogeneous": True}), ("spread 0.5", {}, {"spread": 0.5}),
                       ("spread 1*", {}, {}), ("spread 1.5", {}, {"spread": 1.5}))),
    ("interleaved share", (("0", {}, {"interleaved_share": 0.0}), ("0.2*", {}, {}),
                           ("0.5", {}, {"interleaved_share": 0.5}))),
    ("generation share", (("0", {}, {"gen_share": 0.0}), ("0.25*", {}, {}), ("0.5", {}, {"gen_share": 0.5}))),
    ("global batch (M)", (("1152", {"global_batch": 1152}, {}), ("2304*", {}, {}),
                          ("4608", {"global_batch": 4608}, {}))),
    ("sequences per microbatch", (("1*", {}, {}), ("2", {"seqs_per_microbatch": 2}, {}))),
    ("encoder+generator frozen", (("no*", {}, {}), ("yes", {"frozen": True}, {}))),
    ("gradient sync exposed", (("all*", {}, {}), ("none (overlapped)", {"sync": 0.0}, {}))),
    ("GPU memory for the planner", (*((f"{gb} GB", {"memory_gb": float(gb)}, {}) for gb in (32, 48, 64)),
                                    ("80 GB*", {}, {}), ("141 GB", {"memory_gb": 141.0}, {}))),
)
"""One assumption at a time (* = the default), on A800 for every backbone."""

SWEEP_AT_PP8 = tuple((f"at Megatron PP=8: {axis}", tuple((label, {**PP8, **changes}, data)
                                                          for label, changes, data in values))
                     for axis, values in SWEEP if axis in ("heterogeneity", "generator", "tokens per image (cap)"))
"""The data and model-size axes again, with Megatron-LM held at 8 pipeline stages (the regime in which
the encoder overloads its first stage)."""


def run_sweep(scenario: Scenario, num_batches: int, backbones: tuple[str, ...],
              axes=SWEEP + SWEEP_AT_PP8) -> list[dict]:
    """Records (axis, value, backbone, ratios, MFUs) of every sweep point."""
    cache: dict[DataSpec, list[np.ndarray]] = {}
    records = []
    points = [(axis, value) for axis, values in axes for value in values]
    for axis, (label, changes, data_changes) in points:
        spec = dataclasses.replace(DataSpec(), **data_changes)
        for backbone in backbones:
            sc = dataclasses.replace(scenario, backbone=backbone, **changes)
            if spec not in cache:
                cache[spec] = make_batches(spec, num_batches, sc.global_batch)
            batches = cache[spec]
            if len(batches[0]) != sc.global_batch:
                batches = make_batches(spec, num_batches, sc.global_batch)
            ladder = run_ladder(sc, batches, compare_pick=False)
            records.append({"axis": axis, "value": label, "backbone": backbone, "best": ladder.best_ratio(),
                            **{f"x_{r['rung']}": r["x_megatron"] for r in ladder.rows},
                            "mfu_megatron": ladder.rows[0]["mfu"], "mfu_ours": ladder.row("ours")["mfu"],
                            "megatron": ladder.plans["monolithic"].describe() if ladder.plans["monolithic"] else None})
        line = " ".join(f"{r['backbone']:>3s} {r['best']:5.2f}x ({r['x_disagg']:4.2f}x)"
                        for r in records[-len(backbones):])
        print(f"  {axis:42s} {label:27s} {line}", flush=True)
    return records


def decisive(records: list[dict]) -> list[tuple[str, float, float]]:
    """Axes by how far they move the best ratio: (axis, largest spread over values for one
    backbone, highest ratio reached), largest spread first."""
    out = []
    for axis in dict.fromkeys(r["axis"] for r in records):
        rows = [r for r in records if r["axis"] == axis]
        spreads = []
        for backbone in dict.fromkeys(r["backbone"] for r in rows):
            ratios = [r["best"] for r in rows if r["backbone"] == backbone and not math.isnan(r["best"])]
            spreads.append(max(ratios) - min(ratios) if ratios else 0.0)
        reached = [r["best"] for r in rows if not math.isnan(r["best"])]
        out.append((axis, max(spreads), max(reached, default=math.nan)))
    return sorted(out, key=lambda t: -t[1])


XMAX = 3.0
"""Sweep panel: ratios above this are drawn at the edge with their value."""


def plot(path: Path, ladders: list[Ladder], records: list[dict] | None) -> None:
    """Bars of every rung's throughput relative to Megatron-LM per backbone, one panel per
    accelerator; with a sweep, a third panel with the best ratio at every sweep point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    accelerators = list(dict.fromkeys(lad.scenario.accelerator for lad in ladders))
    panels = len(accelerators) + (1 if records else 0)
    fig, axes = plt.subplots(panels, 1, figsize=(11, 3.6 * len(accelerators) + (7.5 if records else 0)),
                             gridspec_kw={"height_ratios": [1] * len(accelerators) + ([2.2] if records else [])})
    axes = np.atleast_1d(axes)
    colors = plt.get_cmap("tab10")
    for ax, acc in zip(axes, accelerators):
        group = [lad for lad in ladders if lad.scenario.accelerator == acc]
        width = 0.8 / len(RUNGS)
        for i, rung in enumerate(RUNGS):
            xs = np.arange(len(group)) + (i - (len(RUNGS) - 1) / 2) * width
            ys = [lad.row(rung.key)["x_megatron"] for lad in group]
            bars = ax.bar(xs, ys, width, label=rung.label, color=colors(i))
            for bar, lad in zip(bars, group):
                ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + 0.02,
                        f"{lad.row(rung.key)['mfu']:.0%}", ha="center", fontsize=6.5)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(2.2, color="red", linestyle="--", linewidth=1, label="paper: up to 2.2x")
        ax.set_xticks(range(len(group)), [f"{lad.scenario.backbone} ({lad.scenario.gpus} {acc})" for lad in group])
        ax.set_ylabel("throughput / Megatron-LM")
        ax.set_ylim(0, 2.4)
        ax.set_title(f"SIMULATION on {acc}: ablation ladder (label on bar: MFU)", fontsize=9)
        ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, 0.82))
    if records:
        ax = axes[-1]
        points = list(dict.fromkeys((r["axis"], r["value"]) for r in records))
        for j, backbone in enumerate(dict.fromkeys(r["backbone"] for r in records)):
            ys = [next((r["best"] for r in records if (r["axis"], r["value"]) == p and r["backbone"] == backbone),
                       math.nan) for p in points]
            clipped = np.minimum(ys, XMAX)
            ax.scatter(clipped, range(len(points)), color=colors(j), label=backbone, s=18, zorder=3)
            for k, y in enumerate(ys):
                if y > XMAX:
                    ax.text(XMAX, k, f" {backbone} {y:.1f}x", fontsize=6, va="center", color=colors(j))
        ax.set_yticks(range(len(points)), [f"{a}: {v}" for a, v in points], fontsize=7)
        ax.invert_yaxis()
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.axvline(2.2, color="red", linestyle="--", linewidth=1)
        ax.grid(axis="x", alpha=0.3)
        ax.set_xlim(0.5, XMAX + 0.6)
        ax.set_xlabel("best disaggregated rung / Megatron-LM (A800); * = default; missing: no Megatron grid fits")
        ax.set_title("SIMULATION: one assumption at a time", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=1152, help="GPU budget of every layout (144 nodes x 8)")
    parser.add_argument("--global-batch", type=int, default=2304, help="8192-token sequences per step")
    parser.add_argument("--batches", type=int, default=3, help="global batches averaged per ladder")
    parser.add_argument("--backbones", help="default 7B,13B,72B (--quick: 7B)")
    parser.add_argument("--accelerators", help="default A800,H100 (--quick: A800)")
    parser.add_argument("--seqs-per-microbatch",
                        help="sequences per rank per microbatch, one ladder per value (default 1,2,4; --quick: 1)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: one batch of 1152 sequences, 7B on A800 at S=1 unless named, no sweep")
    parser.add_argument("--sweep", action="store_true", help="vary one assumption at a time (A800)")
    parser.add_argument("--plot", type=Path, help="write the ladder (and sweep) chart here (PNG)")
    parser.add_argument("--json", type=Path, help="write every ladder and sweep point here")
    args = parser.parse_args(argv)
    given = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.batches, args.global_batch, args.sweep = 1, 1152, False
    backbones = tuple((args.backbones or ("7B" if args.quick else "7B,13B,72B")).split(","))
    accelerators = tuple((args.accelerators or ("A800" if args.quick else "A800,H100")).split(","))
    per_microbatch = [int(v) for v in (args.seqs_per_microbatch or ("1" if args.quick else "1,2,4")).split(",")]
    if any(S < 1 or args.global_batch % S for S in per_microbatch):
        parser.error(f"every --seqs-per-microbatch must be >= 1 and divide --global-batch {args.global_batch}, "
                     f"got {per_microbatch}")
    start = time.perf_counter()
    print(f"SIMULATION (nothing measured): {args.gpus} simulated GPUs, {args.batches} global batch(es) of "
          f"{args.global_batch} LAION-like sequences of {DataSpec().seq_len} tokens; ViT-H/14 encoder, "
          "SD-2.1 generator; iteration = the service's exact 1F1B simulator + gradient sync")
    batches = make_batches(DataSpec(), args.batches, args.global_batch)
    features = np.concatenate(batches)
    enc, gen, tokens = features[:, ENC_T], features[:, GEN], features[:, TOKENS]
    print(f"data per sequence: {enc.mean():.0f} image tokens ({enc.sum() / tokens.sum():.0%} of tokens, CV "
          f"{enc.std() / enc.mean():.2f}), {gen.mean():.2f} images to generate (CV {gen.std() / gen.mean():.2f}), "
          f"{tokens.mean() / DataSpec().seq_len:.1%} filled")
    ladders, skipped = [], []
    for S in per_microbatch:
        for acc in accelerators:
            for backbone in backbones:
                scenario = Scenario(backbone=backbone, accelerator=acc, gpus=args.gpus, global_batch=args.global_batch,
                                    seqs_per_microbatch=S)
                try:
                    ladders.append(run_ladder(scenario, batches))
                except NoLayout as e:  # S sequences' activations per microbatch fit no layout's memory
                    skipped.append(f"{backbone} on {acc} at S={S}: {e}")
                    print(f"\n{skipped[-1]}: skipped")
                    continue
                print_ladder(ladders[-1])
    print_summary(ladders)
    records = None
    if args.sweep:
        print(f"\nsweep (A800, {args.batches} batch(es) per point): best rung / Megatron-LM, (b. disaggregated in "
              "arrival order / Megatron-LM)")
        records = run_sweep(Scenario(gpus=args.gpus, global_batch=args.global_batch), args.batches, backbones)
        print("\nwhat moves the ratio most (largest change over an axis's values, for one backbone):")
        for axis, spread, reached in decisive(records):
            print(f"  {axis:42s} moves it by {spread:4.2f}, highest {reached:4.2f}x")
    if args.plot:
        plot(args.plot, ladders, records)
        print(f"wrote {args.plot}")
    if args.json:
        doc = benchjson.document("paper", quick=args.quick, argv=[str(BENCH / "paper.py"), *given])
        doc["tables"] += [ladder_table(ladders), planners_table(ladders)]
        for t in doc["tables"]:
            t["notes"] += [f"skipped: {line}" for line in skipped]
        doc |= {"ladders": [ladder_json(lad) for lad in ladders], "sweep": records}
        args.json.write_text(json.dumps(benchjson.check(doc), default=float, indent=1))
        print(f"wrote {args.json}")
    print(f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
