"""Typed, validated job configuration: everything that determines the plan of a job."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

from preprocess_service.errors import ConfigError


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(kw_only=True, slots=True, frozen=True)
class ImageConfig:
    """How images are resized for the encoder (dynamic resolution, aspect ratio kept)."""

    patch_size: int = 14
    """ViT patch edge, pixels."""
    merge_size: int = 2
    """Patches merged into one token along each axis."""
    max_pixels: int = 1024 * 28 * 28
    """Cap on the resized image's height * width (default: 1024 tokens)."""
    min_pixels: int = 4 * 28 * 28
    """Floor on the resized image's height * width."""
    max_source_pixels: int = 64_000_000
    """Source images above this many pixels are decompression bombs and get skipped."""

    def __post_init__(self) -> None:
        _require(self.patch_size > 0, f"image.patch_size must be positive, got {self.patch_size}")
        _require(self.merge_size > 0, f"image.merge_size must be positive, got {self.merge_size}")
        _require(self.min_pixels >= self.factor**2,
                 f"image.min_pixels ({self.min_pixels}) must hold at least one token ({self.factor**2} pixels)")
        _require(self.max_pixels >= self.min_pixels,
                 f"image.max_pixels ({self.max_pixels}) is below image.min_pixels ({self.min_pixels})")
        _require(self.max_source_pixels > 0, "image.max_source_pixels must be positive")

    @property
    def factor(self) -> int:
        """Pixels along one side of one token: both resized sides are multiples of it."""
        return self.patch_size * self.merge_size


@dataclass(kw_only=True, slots=True, frozen=True)
class AudioConfig:
    """How audio clips become log-mel frames for the audio encoder (Whisper-like defaults).

    A clip of d seconds gets floor(d * sample_rate / hop_length / token_stride) tokens (at least
    one) and exactly tokens * token_stride frames: the mel is cropped or padded to that, so the
    size planned from the JSON duration is the size delivered.
    """

    sample_rate: int = 16000
    """Hz every clip is resampled to (after mixing down to mono)."""
    n_mels: int = 128
    """Mel bins per frame."""
    n_fft: int = 400
    """FFT size, samples (25 ms at 16 kHz); also the window length."""
    hop_length: int = 160
    """Samples between frames (10 ms at 16 kHz)."""
    token_stride: int = 4
    """Mel frames per audio token (the encoder's downsampling)."""
    max_seconds: float = 30.0
    """Longer clips are cut to their first max_seconds."""

    def __post_init__(self) -> None:
        for name in ("sample_rate", "n_mels", "n_fft", "hop_length", "token_stride"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, f"audio.{name} must be a positive integer, got {value!r}")
        _require(self.max_seconds > 0, f"audio.max_seconds must be positive, got {self.max_seconds}")

    def num_tokens(self, seconds: float) -> int:
        """Tokens of a clip of ``seconds`` (after the max_seconds cut)."""
        samples = int(min(seconds, self.max_seconds) * self.sample_rate)
        return max(1, samples // self.hop_length // self.token_stride)


@dataclass(kw_only=True, slots=True, frozen=True)
class GenerationConfig:
    """Images the generator must produce: which, at what size, and their place in the sequence."""

    image_size: int = 256
    """Edge of the square target the generator trains on, pixels (centre crop, then resize)."""
    query_tokens: int = 64
    """Backbone tokens per generated image, whose hidden states condition the generator."""
    select: str = "listed"
    """Which images are generation targets: "listed" (the members a sample's JSON names in
    "generate"), "all" (every image: text-to-image training on plain LAION) or "none"."""

    def __post_init__(self) -> None:
        _require(isinstance(self.image_size, int) and self.image_size >= 8,
                 f"generation.image_size must be an integer >= 8, got {self.image_size!r}")
        _require(isinstance(self.query_tokens, int) and self.query_tokens > 0,
                 f"generation.query_tokens must be a positive integer, got {self.query_tokens!r}")
        _require(self.select in ("listed", "all", "none"),
                 f"generation.select must be 'listed', 'all' or 'none', got {self.select!r}")


@dataclass(kw_only=True, slots=True, frozen=True)
class CostConfig:
    """Forward-time coefficients (seconds) of the per-sequence cost model, see cost.py.

    The defaults are order-of-magnitude placeholders for a ~7B backbone with a ViT-L
    encoder on one accelerator; calibrate them for a real job.
    """

    enc_linear_s: float = 2.0e-6
    """Encoder seconds per image or audio token."""
    enc_quadratic_s: float = 2.0e-9
    """Encoder seconds per squared image token count (self-attention inside one image)."""
    bb_linear_s: float = 6.0e-6
    """Backbone seconds per non-padding token."""
    bb_quadratic_s: float = 1.0e-10
    """Backbone seconds per squared document length (attention masked per document)."""
    gen_per_image_s: float = 0.02
    """Generator seconds per image to generate."""
    enc_backward_factor: float = 2.0
    bb_backward_factor: float = 2.0
    gen_backward_factor: float = 2.0
    enc_frozen: bool = False
    """A frozen encoder has no backward pass."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float):
                _require(value >= 0.0, f"cost.{f.name} must be >= 0, got {value}")


@dataclass(kw_only=True, slots=True, frozen=True)
class JobConfig:
    """Everything that determines a job's plan; the plan of step k is a function of this and the data."""

    shards: tuple[str, ...]
    """Shard URLs or paths, brace patterns allowed; a directory stands for its *.tar files."""
    seq_len: int = 8192
    """Tokens per packed sequence."""
    dp_size: int = 1
    """Data-parallel ranks."""
    num_microbatches: int = 4
    """Microbatches per DP rank per step."""
    seqs_per_microbatch: int = 1
    """Packed sequences per microbatch."""
    seed: int = 0
    num_epochs: int = 1
    shuffle_buffer: int = 256
    """Samples in the seeded shuffle buffer (1 = keep shard order)."""
    shard_shuffle: bool = True
    """Shuffle the shard order per epoch (seeded)."""
    reorder_algorithm: str = "ours"
    """Registry name of the batch planner (reorder.instance.PLANNERS): which rank trains on which
    sequences, grouped into which microbatches, in which order."""
    stage_map: tuple[str, ...] = ("enc", "bb", "gen")
    """The trainer's pipeline stages, each running a module or a share of one ("bb/2"); the planner
    simulates this 1F1B pipeline per DP rank."""
    enc_shared_by: int = 1
    """Backbone DP ranks that one encoder replica serves (a disaggregated encoder with dp_size / this
    replicas); > 1 couples those ranks' microbatch slots, and the planner plans for that."""
    gen_shared_by: int = 1
    """Backbone DP ranks that one generator replica serves, as enc_shared_by."""
    pack_window: int = 8
    """Open sequences the best-fit packer fills at once (1 = sequential packing)."""
    cost_feedback: bool = False
    """Refit the cost model from the stage times trainers report (ReportTimings) and price the steps
    planned afterwards with it. Plans then depend on those reports: a single-node service restarted
    mid-job replans later steps with the configured coefficients (replicas on Redis do not: their
    plans are committed)."""
    image: ImageConfig = field(default_factory=ImageConfig)
    audio: AudioConfig = field(default_factory=AudioConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    cost: CostConfig = field(default_factory=CostConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shards", tuple(self.shards))
        object.__setattr__(self, "stage_map", tuple(self.stage_map))
        _require(len(self.shards) > 0, "shards is empty: give at least one shard path or URL")
        for name in ("seq_len", "dp_size", "num_microbatches", "seqs_per_microbatch",
                     "num_epochs", "shuffle_buffer", "pack_window", "enc_shared_by", "gen_shared_by"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, f"{name} must be a positive integer, got {value!r}")
        _require(self.seq_len >= 16, f"seq_len must be at least 16 tokens, got {self.seq_len}")
        _require(self.seed >= 0, f"seed must be >= 0, got {self.seed}")
        from preprocess_service.reorder.instance import PLANNERS

        _require(self.reorder_algorithm in PLANNERS,
                 f"unknown reorder_algorithm {self.reorder_algorithm!r}; known: {sorted(PLANNERS)}")
        try:
            model = self.stage_model()
        except ValueError as exc:
            raise ConfigError(f"stage_map {list(self.stage_map)}: {exc}") from None
        try:
            model.check_ranks(self.dp_size)
        except ValueError as exc:
            raise ConfigError(f"enc_shared_by / gen_shared_by: {exc}") from None

    def stage_model(self):
        """The simulator's model of one DP rank's pipeline (simulate.StageModel)."""
        from preprocess_service.simulate import StageModel

        if not self.stage_map:
            raise ValueError("at least one stage is needed")
        cost = self.cost
        return StageModel(stage_map=self.stage_map,
                          bwd_factor=(0.0 if cost.enc_frozen else cost.enc_backward_factor,
                                      cost.bb_backward_factor, cost.gen_backward_factor),
                          shared_by=(self.enc_shared_by, 1, self.gen_shared_by))

    @property
    def global_batch(self) -> int:
        """Sequences per step."""
        return self.dp_size * self.num_microbatches * self.seqs_per_microbatch

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def job_id(self) -> str:
        """Stable id: a hash of the normalised config, so ranks sending the same config share a job."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return "job-" + hashlib.sha256(blob.encode()).hexdigest()[:16]
