"""Per-module cost profiles for the orchestration planner: forward/backward seconds and memory of
one module on one microbatch, as a function of its tensor-parallel (TP) size and the microbatch's
content.

Two sources share one interface (``ModuleProfile``):
- ``FlopProfile``: from a module's published size (parameters, layers, hidden size) and a stated
  accelerator (peak FLOP/s, achievable efficiency, TP link bandwidth): what the paper-scale
  simulation uses, labelled as simulation everywhere it is printed.
- ``MeasuredProfile``: from seconds measured on this machine at TP=1 (the service's calibrated
  cost model, or the trainer's own step timings), scaled to TP by a stated efficiency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Content:
    """What one microbatch holds (averages over a global batch are fine)."""

    tokens: int
    """Backbone tokens (text + media placeholders) of the microbatch."""
    image_tokens: int
    """Encoder output tokens of its images (after patch merging)."""
    gen_images: float
    """Images the generator must produce."""
    doc_len: int = 0
    """Mean document length in tokens (attention cost); 0: one document per sequence."""
    image_len: float = 1024.0
    """Size-weighted mean tokens per image, sum(t^2) / sum(t) over the images (the encoder's
    attention runs inside one image)."""


@dataclass(frozen=True, slots=True)
class Accelerator:
    name: str
    peak_flops: float
    """Dense bf16 FLOP/s."""
    efficiency: float
    """Share of peak a well-shaped matmul workload reaches at TP=1."""
    memory_bytes: float
    tp_link_bytes_s: float
    """Intra-node link bandwidth per GPU for TP all-reduces (bytes/s)."""
    dp_link_bytes_s: float
    """Inter-node bandwidth per GPU for gradient all-reduce and pipeline sends (bytes/s)."""
    max_tp: int = 8
    """GPUs per node: TP stays inside one."""


H100 = Accelerator("H100 SXM (simulated)", peak_flops=989e12, efficiency=0.55, memory_bytes=80e9,
                   tp_link_bytes_s=450e9, dp_link_bytes_s=50e9)
A800 = Accelerator("A800 SXM (simulated)", peak_flops=312e12, efficiency=0.65, memory_bytes=80e9,
                   tp_link_bytes_s=200e9, dp_link_bytes_s=12.5e9)
"""The paper's GPU (DistTrain, SIGCOMM'25): an A100 with NVLink cut to 400 GB/s (200 GB/s each way,
what a TP all-reduce sees); 4 x 200 Gb/s RoCE per 8-GPU node = 12.5 GB/s per GPU between nodes.
Efficiency 0.65: large bf16 GEMMs reach about 75-80% of 312 TFLOP/s on an A100, whole transformer
layers (attention, norms, activations) less; an assumption, not a measurement."""
CPU_PROCESS = Accelerator("CPU process", peak_flops=1e11, efficiency=1.0, memory_bytes=8e9,
                          tp_link_bytes_s=5e9, dp_link_bytes_s=5e9)


class ModuleProfile:
    """Seconds and bytes of one module; subclasses implement ``fwd_s`` and ``memory_bytes``."""

    name: str
    params: float
    bwd_factor: float

    def fwd_s(self, content: Content, tp: int, layers_share: float = 1.0) -> float:
        raise NotImplementedError

    def bwd_s(self, content: Content, tp: int, layers_share: float = 1.0) -> float:
        return self.bwd_factor * self.fwd_s(content, tp, layers_share)

    def memory_bytes(self, content: Content, tp: int, layers_share: float, in_flight: int, dp: int) -> float:
        raise NotImplementedError

    def flops(self, content: Content) -> float:
        """Model FLOPs of forward + backward (for MFU)."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class FlopProfile(ModuleProfile):
    """A transformer-like module priced by its FLOPs on an Accelerator.

    forward FLOPs = 2 * params * work + 2 * layers * hidden * attention, where work is the tokens
    (or patches, or latent pixels) it processes and attention the sum of squared sequence lengths;
    TP divides the FLOPs and costs efficiency (5% per doubling) plus two all-reduces of the
    activations per layer; backward = bwd_factor * forward."""

    name: str
    params: float
    layers: int
    hidden: int
    accelerator: Accelerator
    work_per: str
    """"token": backbone tokens; "image_token": encoder tokens x patches_per_token; "gen_image": per image."""
    patches_per_token: int = 1
    """Encoder patches per output token (2x2 merge: 4)."""
    work_per_gen_image: float = 0.0
    """Generator: positions per image (latent pixels)."""
    bwd_factor: float = 2.0
    act_bytes_per_work: float = 34.0
    """Activation bytes per unit of work per hidden unit per layer (Megatron, selective recompute)."""

    def _work(self, c: Content) -> tuple[float, float]:
        """(positions processed, sum of squared attention lengths)."""
        if self.work_per == "token":
            doc = c.doc_len or c.tokens
            return c.tokens, c.tokens * doc
        if self.work_per == "image_token":
            patches = c.image_tokens * self.patches_per_token
            per_image = c.image_len * self.patches_per_token
            return patches, patches * per_image
        positions = c.gen_images * self.work_per_gen_image
        return positions, positions * self.work_per_gen_image

    def flops_fwd(self, c: Content) -> float:
        work, attention = self._work(c)
        return 2 * self.params * work + 2 * self.layers * self.hidden * attention

    def flops(self, c: Content) -> float:
        return (1 + self.bwd_factor) * self.flops_fwd(c)

    def _throughput(self, tp: int) -> float:
        """FLOP/s of one TP group of ``tp`` GPUs."""
        acc = self.accelerator
        return tp * acc.peak_flops * acc.efficiency * (1 - 0.05 * math.log2(tp))

    def _comm_s(self, work: float, tp: int, layers_share: float = 1.0) -> float:
        """Two all-reduces of the activations per layer (bf16, ring) over the TP link."""
        if tp == 1:
            return 0.0
        bytes_moved = 2 * self.layers * layers_share * work * self.hidden * 2 * (tp - 1) / tp
        return bytes_moved / self.accelerator.tp_link_bytes_s

    def fwd_s(self, c: Content, tp: int, layers_share: float = 1.0) -> float:
        work, _ = self._work(c)
        return self.flops_fwd(c) * layers_share / self._throughput(tp) + self._comm_s(work, tp, layers_share)

    def flop_coefficients(self) -> tuple[float, float]:
        """(linear, quadratic) forward FLOPs in the units of the service's per-sequence cost model
        (preprocess_service/core/cost.py): per backbone token and per squared document length; per
        encoder (merged) image token and per squared token count of one image; per generated image
        (quadratic 0). ``flops_fwd`` of a Content is linear * work + quadratic * attention in those units."""
        if self.work_per == "token":
            return 2 * self.params, 2 * self.layers * self.hidden
        if self.work_per == "image_token":
            k = self.patches_per_token
            return 2 * self.params * k, 2 * self.layers * self.hidden * k * k
        w = self.work_per_gen_image
        return 2 * self.params * w + 2 * self.layers * self.hidden * w * w, 0.0

    def cost_coefficients(self, tp: int) -> tuple[float, float]:
        """(linear, quadratic) forward seconds at TP ``tp`` in the cost model's units (see
        ``flop_coefficients``), TP communication included: what CostConfig's ``*_linear_s`` and
        ``*_quadratic_s`` (or ``gen_per_image_s``) would be for this module on this accelerator."""
        linear, quadratic = self.flop_coefficients()
        per_unit = {"token": 1, "image_token": self.patches_per_token}.get(self.work_per, self.work_per_gen_image)
        return (linear / self._throughput(tp) + self._comm_s(per_unit, tp),
                quadratic / self._throughput(tp))

    def memory_bytes(self, c: Content, tp: int, layers_share: float, in_flight: int, dp: int) -> float:
        params = self.params * layers_share / tp
        weights = params * (2 + 2 + 12 / dp)  # bf16 weights and grads; fp32 master + Adam sharded over DP
        work, _ = self._work(c)
        activations = self.act_bytes_per_work * work * self.hidden * self.layers * layers_share / tp
        return weights + activations * in_flight


@dataclass(frozen=True, slots=True)
class MeasuredProfile(ModuleProfile):
    """Measured forward seconds at TP=1 as a linear function of content, and a parameter count."""

    name: str
    params: float
    seconds_per: tuple[float, float, float, float]
    """Forward seconds per backbone token, per squared document length, per encoder token, per image to generate."""
    bwd_factor: float = 2.0
    tp_efficiency: float = 0.8
    """Share of linear speed-up per TP doubling (0.8: TP=2 runs 1.6x faster)."""
    accelerator: Accelerator = CPU_PROCESS

    def fwd_s(self, c: Content, tp: int, layers_share: float = 1.0) -> float:
        per_token, per_sq, per_enc, per_gen = self.seconds_per
        doc = c.doc_len or c.tokens
        t = per_token * c.tokens + per_sq * c.tokens * doc + per_enc * c.image_tokens + per_gen * c.gen_images
        return t * layers_share / (tp * self.tp_efficiency ** math.log2(tp))

    def memory_bytes(self, c: Content, tp: int, layers_share: float, in_flight: int, dp: int) -> float:
        return self.params * layers_share / tp * (4 + 12 / dp)

    def flops(self, c: Content) -> float:
        return (1 + self.bwd_factor) * self.fwd_s(c, 1) * self.accelerator.peak_flops
