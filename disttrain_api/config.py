"""Typed, validated job configuration: everything that determines the plan of a job."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import cast

from disttrain_api.errors import ConfigError
from disttrain_api.layout import MAX_SPLIT, StageModel

PLANNER_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
"""The form of a planner's name. Which names exist is the service's registry's business
(preprocess_service/core/reorder: one file per planner); a server refuses a job naming a planner it
does not have (INVALID_ARGUMENT, listing the ones it has), so a planner added on the service side
needs no change here."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _in_range(name: str, value, low, high, *, integer: bool = True) -> None:
    """ConfigError naming ``name`` unless ``value`` is a number (an integer if asked) in [low, high]."""
    kind = int if integer else (int, float)
    ok = isinstance(value, kind) and not isinstance(value, bool) and math.isfinite(value) and low <= value <= high
    _require(ok, f"{name} must be {'an integer' if integer else 'a number'} in [{low:g}, {high:g}], got {value!r}")


MONOLITHIC = ("enc+bb+gen",)
"""JobConfig.stage_map of a model that does not disaggregate (one FSDP/DDP model: encoder, backbone
and generator on every rank, one stage): the planner balances whole microbatches."""
DISAGGREGATED = ("enc", "bb", "gen")
"""JobConfig.stage_map's default: encoder, backbone and generator as three pipeline stages (trainer/)."""

MAX_SEQ_LEN = 1 << 20
MAX_GLOBAL_BATCH = 1 << 20
MAX_STAGES = 256


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

    BOUNDS = {"patch_size": (1, 64), "merge_size": (1, 8), "min_pixels": (1, 4096 * 4096),
              "max_pixels": (1, 4096 * 4096), "max_source_pixels": (1, 1 << 30)}
    """Accepted range of every field (a job spec outside it is INVALID_ARGUMENT)."""

    def __post_init__(self) -> None:
        for name, (low, high) in self.BOUNDS.items():
            _in_range(f"image.{name}", getattr(self, name), low, high)
        _require(self.min_pixels >= self.factor**2,
                 f"image.min_pixels ({self.min_pixels}) must hold at least one token ({self.factor**2} pixels)")
        _require(self.max_pixels >= self.min_pixels,
                 f"image.max_pixels ({self.max_pixels}) is below image.min_pixels ({self.min_pixels})")

    @property
    def factor(self) -> int:
        """Pixels along one side of one token: both resized sides are multiples of it."""
        return self.patch_size * self.merge_size


@dataclass(kw_only=True, slots=True, frozen=True)
class VideoConfig:
    """How videos become frames for the encoder (Qwen2-VL's rule): ``fps`` frames a second, at most
    ``max_frames``, spread evenly over the video, a multiple of ``temporal_patch`` (the last frame
    repeated for a video too short); each frame resized by the image rule (ImageConfig's patch and
    merge sizes) within ``max_pixels``; ``temporal_patch`` frames merged into one token per
    patch, so a video of n frames of h x w costs n / temporal_patch x the tokens of one h x w image."""

    fps: float = 2.0
    """Frames sampled per second of video."""
    max_frames: int = 32
    """Most frames sampled from one video."""
    temporal_patch: int = 2
    """Consecutive frames merged per token (the encoder's temporal patch)."""
    max_pixels: int = 256 * 28 * 28
    """Cap on a resized frame's height * width (default: 256 tokens per temporal patch)."""
    max_source_pixels: int = 4096 * 4096
    """A video whose frames are larger than this is refused (decompression bomb)."""
    max_seconds: float = 3600.0
    """A longer video is refused."""
    max_decoded_frames: int = 20_000
    """A video needing more frames decoded to reach its samples (a million tiny frames) is refused."""
    max_decoded_pixels: int = 2_000_000_000
    """Bound on the pixels decoded for one video (frames x their size): the decode's time bound."""

    BOUNDS = {"max_frames": (1, 1024), "temporal_patch": (1, 16), "max_pixels": (1, 4096 * 4096),
              "max_source_pixels": (1, 1 << 30), "max_decoded_frames": (1, 10_000_000),
              "max_decoded_pixels": (1, 1 << 40)}
    """Accepted range of every integer field; fps is in (0, 120], max_seconds in (0, 86400]."""

    def __post_init__(self) -> None:
        for name, (low, high) in self.BOUNDS.items():
            _in_range(f"video.{name}", getattr(self, name), low, high)
        _in_range("video.fps", self.fps, 1e-3, 120.0, integer=False)
        _in_range("video.max_seconds", self.max_seconds, 1e-3, 86400.0, integer=False)
        _require(self.max_frames >= self.temporal_patch,
                 f"video.max_frames ({self.max_frames}) must hold one temporal patch ({self.temporal_patch})")


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

    BOUNDS = {"sample_rate": (1000, 96_000), "n_mels": (1, 512), "n_fft": (16, 8192), "hop_length": (1, 8192),
              "token_stride": (1, 64)}
    """Accepted range of every integer field; max_seconds is in (0, 3600]."""

    def __post_init__(self) -> None:
        for name, (low, high) in self.BOUNDS.items():
            _in_range(f"audio.{name}", getattr(self, name), low, high)
        _in_range("audio.max_seconds", self.max_seconds, 0.001, 3600.0, integer=False)
        _require(self.hop_length <= self.n_fft,
                 f"audio.hop_length ({self.hop_length}) must not exceed audio.n_fft ({self.n_fft})")

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
        _in_range("generation.image_size", self.image_size, 8, 2048)
        _in_range("generation.query_tokens", self.query_tokens, 1, 4096)
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
            if isinstance(value, float):  # seconds or factors: finite, non-negative, below a million
                _in_range(f"cost.{f.name}", value, 0.0, 1e6, integer=False)


MODALITIES = ("text", "image", "audio", "video")
"""Member kinds a dataset may use (DatasetConfig.modalities)."""
DEDUP = ("pass", "shard")
MANIFESTS = ("auto", "off")
MIX_BY = ("samples", "tokens")
MIX_EPOCH = ("first_exhausted", "all_exhausted")
MAX_DATASETS = 256
_DATASET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(kw_only=True, slots=True, frozen=True)
class DatasetConfig:
    """One dataset of a weighted mixture (JobConfig.datasets)."""

    name: str
    """Short name for reports: a letter or digit, then up to 63 letters, digits, '_', '.' or '-'."""
    shards: tuple[str, ...]
    """Shard URLs or paths of this dataset, as JobConfig.shards."""
    weight: float = 1.0
    """Relative share of the mixture (normalised over the datasets), by samples or by tokens (JobConfig.mix_by)."""
    modalities: tuple[str, ...] = MODALITIES
    """Member kinds used from this dataset's samples ("text", "image", "audio", "video"); members of other
    kinds are ignored (e.g. ("text",) trains on the captions of an image-text set only)."""
    image: ImageConfig | None = None
    """Image sizing for this dataset's encoder images (None: the job's); its patch_size and
    merge_size must be the job's (one encoder)."""
    generate: str = ""
    """Which of its images are generation targets: "listed", "all" or "none" ("" = the job's
    generation.select). Size and query tokens stay the job's: one generator trains on all of them."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shards", tuple(self.shards))
        object.__setattr__(self, "modalities", tuple(self.modalities))
        _require(isinstance(self.name, str) and bool(_DATASET_NAME.match(self.name)),
                 f"dataset name {self.name!r} must be 1-64 letters, digits, '_', '.' or '-', starting with a "
                 "letter or digit")
        _require(len(self.shards) > 0, f"dataset {self.name!r}: shards is empty")
        _in_range(f"dataset {self.name!r} weight", self.weight, 1e-9, 1e9, integer=False)
        object.__setattr__(self, "weight", float(self.weight))  # 2 and 2.0: one job id
        _require(len(self.modalities) > 0 and all(m in MODALITIES for m in self.modalities)
                 and len(set(self.modalities)) == len(self.modalities),
                 f"dataset {self.name!r}: modalities must be distinct names out of {list(MODALITIES)}, "
                 f"got {list(self.modalities)}")
        _require(self.image is None or isinstance(self.image, ImageConfig),
                 f"dataset {self.name!r}: image must be an ImageConfig")
        _require(self.generate in ("", "listed", "all", "none"),
                 f"dataset {self.name!r}: generate must be '', 'listed', 'all' or 'none', got {self.generate!r}")


MAX_PLUGINS = 16
MAX_PLUGIN_PARAMS_BYTES = 64 << 10
_PLUGIN_NAME = re.compile(r"^[a-z][a-z0-9_.-]{0,63}$")


@dataclass(kw_only=True, slots=True, frozen=True)
class PluginConfig:
    """One operator plugin a job uses (disttrain_api/plugins.py, docs/plugins.md): its registered
    name and parameters. The service refuses a name it has not installed."""

    name: str
    """The name its package registers under the ``disttrain.plugins`` entry points: a lowercase
    letter, then up to 63 lowercase letters, digits, '_', '.' or '-'."""
    params: str | dict = "{}"
    """Its parameters: a JSON object, given as a dict or as JSON text, at most 64 KiB; kept as
    canonical JSON text (sorted keys), so equal parameters make one job id."""

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and bool(_PLUGIN_NAME.match(self.name)),
                 f"plugin name {self.name!r:.80} must be a lowercase letter, then up to 63 lowercase letters, "
                 "digits, '_', '.' or '-'")
        params = self.params
        if isinstance(params, str):
            _require(len(params) <= MAX_PLUGIN_PARAMS_BYTES,
                     f"plugin {self.name!r}: params are {len(params)} characters, more than {MAX_PLUGIN_PARAMS_BYTES}")
            try:
                params = json.loads(params or "{}")
            except (ValueError, RecursionError) as exc:
                raise ConfigError(f"plugin {self.name!r}: params are not JSON ({exc})") from None
        _require(isinstance(params, dict), f"plugin {self.name!r}: params must be a JSON object, got {params!r:.80}")
        try:
            text = json.dumps(params, sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise ConfigError(f"plugin {self.name!r}: params cannot be JSON ({exc})") from None
        _require(len(text) <= MAX_PLUGIN_PARAMS_BYTES,
                 f"plugin {self.name!r}: params are {len(text)} bytes of JSON, more than {MAX_PLUGIN_PARAMS_BYTES}")
        object.__setattr__(self, "params", text)

    @property
    def params_json(self) -> str:
        """The parameters as canonical JSON text."""
        return cast(str, self.params)

    def parsed_params(self) -> dict:
        return json.loads(self.params_json)


@dataclass(kw_only=True, slots=True, frozen=True)
class JobConfig:
    """Everything that determines a job's plan; the plan of step k is a function of this and the data."""

    shards: tuple[str, ...] = ()
    """Shard URLs or paths, brace patterns allowed; a directory stands for its *.tar files (or give
    datasets instead)."""
    datasets: tuple[DatasetConfig, ...] = ()
    """A weighted mixture of datasets instead of shards: each with its name, shards, weight and
    optional modalities and image settings. Blended deterministically (see mix_by, mix_epoch)."""
    mix_by: str = "samples"
    """What the mixture's weights share out: "samples" (documents) or "tokens" (their tokens)."""
    mix_epoch: str = "first_exhausted"
    """When an epoch of a mixture ends: "first_exhausted" (when any dataset runs out: no sample
    repeats, the proportions hold to the end) or "all_exhausted" (datasets that run out start
    again, in a new seeded shard order, until every dataset was read through once)."""
    mix_epoch_samples: int = 0
    """If > 0, an epoch of a mixture is this many samples, datasets that run out starting again
    (overrides mix_epoch)."""
    tokenizer: str = "byte"
    """Text tokenizer: "byte" (UTF-8 bytes), "hf:PATH" (a Hugging Face tokenizer.json) or
    "sentencepiece:PATH" (a .model); a bare PATH ending in .json or .model, or a model folder
    holding tokenizer.json or tokenizer.model, works too. PATH is on the service's machine, under
    the same rules as local shards."""
    seq_len: int = 8192
    """Tokens per packed sequence."""
    dp_size: int = 1
    """Data-parallel ranks."""
    num_microbatches: int = 4
    """Microbatches per DP rank per step."""
    seqs_per_microbatch: int = 1
    """Packed sequences per microbatch."""
    seed: int = 0
    """Seed of every random choice: shard order, sample shuffle, random planners."""
    num_epochs: int = 1
    """Passes over the data."""
    shuffle_buffer: int = 4096
    """Samples shuffled together: the planner reads, permutes and packs blocks of this many
    documents (the packer is flushed at a block's end, so blocks of a few hundred or fewer pad
    more); 1 = keep the read order (blocks of 1024, not permuted)."""
    shard_shuffle: bool = True
    """Shuffle the shard order per epoch (seeded)."""
    open_shards: int = 0
    """Shards each dataset reads from at once, the next sample drawn from one of them by the seed
    (0 = 16 with shard_shuffle, chosen with bench/shuffle.py; else 1: the shards in the given order,
    one after another)."""
    manifests: str = "auto"
    """"auto": a local shard whose img2dataset parquet describes plain image-caption rows is planned
    from the parquet alone (its tar is read only to decode the planned samples); "off": every shard
    is read as a tar."""
    dedup: str = "pass"
    """Duplicate keys: "pass" keeps the first sample of a key read in a dataset's pass, whichever
    shard it is in (8 bytes of memory per sample read this pass; a restore reads the keys read so
    far again); "shard" only within a shard (memory and restore independent of the position; a key
    copied into another shard is another sample)."""
    reorder_algorithm: str = "ours"
    """Registry name of the batch planner (preprocess_service.core.reorder.PLANNERS): which rank trains on which
    sequences, grouped into which microbatches, in which order."""
    stage_map: tuple[str, ...] = DISAGGREGATED
    """The trainer's pipeline stages, each running a module or a share of one ("bb/2"); the planner
    simulates this 1F1B pipeline per DP rank. A model that does not disaggregate (FSDP/DDP) gives
    MONOLITHIC, ("enc+bb+gen",)."""
    enc_shared_by: int = 1
    """Backbone DP ranks that one encoder replica serves (a disaggregated encoder with dp_size / this
    replicas); > 1 couples those ranks' microbatch slots, and the planner plans for that."""
    gen_shared_by: int = 1
    """Backbone DP ranks that one generator replica serves, as enc_shared_by."""
    enc_split_by: int = 1
    """Encoder replicas per backbone DP rank: rank d sends microbatch m to its replica m % this
    (not with enc_shared_by > 1)."""
    gen_split_by: int = 1
    """Generator replicas per backbone DP rank, as enc_split_by."""
    pack_window: int = 8
    """Open sequences the best-fit packer fills at once (1 = sequential packing)."""
    cost_feedback: bool = False
    """Refit the cost model from the stage times trainers report (ReportTimings) and price the steps
    planned afterwards with it. Plans then depend on those reports: a single-node service restarted
    mid-job replans later steps with the configured coefficients (replicas on Redis do not: their
    plans are committed)."""
    max_consecutive_errors: int = 100
    """Bad samples in a row that fail the job (a shard of garbage stops it instead of being skipped
    silently, as Megatron-Energon's failure tolerance)."""
    max_error_fraction: float = 0.5
    """Share of an epoch's samples read so far that may be bad before the job fails (checked from
    the 100th sample on; 1.0: never)."""
    plugins: tuple[PluginConfig, ...] = ()
    """Operator plugins run on every sample, in this order (PluginConfig; docs/plugins.md): sample
    hooks before parsing, media hooks after decoding. At most 16, each name once."""
    image: ImageConfig = field(default_factory=ImageConfig)
    video: VideoConfig = field(default_factory=VideoConfig)
    audio: AudioConfig = field(default_factory=AudioConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    cost: CostConfig = field(default_factory=CostConfig)

    BOUNDS = {"seq_len": (16, MAX_SEQ_LEN), "dp_size": (1, 65_536), "num_microbatches": (1, 4096),
              "seqs_per_microbatch": (1, 1024), "seed": (0, 2**63 - 1), "num_epochs": (1, 1_000_000),
              "shuffle_buffer": (1, 1 << 20), "open_shards": (0, 1024), "pack_window": (1, 1024),
              "max_consecutive_errors": (1, 1_000_000)}
    """Accepted range of every integer field (INVALID_ARGUMENT outside it); also enc_shared_by and
    gen_shared_by in [1, dp_size], enc_split_by and gen_split_by in [1, MAX_SPLIT], max_error_fraction
    in (0, 1], at most 2^20 sequences per step and 256 stages. A server may lower seq_len's bound
    and the bytes of a microbatch (its max_seq_len and max_microbatch_bytes)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shards", tuple(self.shards))
        object.__setattr__(self, "datasets", tuple(self.datasets))
        object.__setattr__(self, "stage_map", tuple(self.stage_map))
        object.__setattr__(self, "plugins", tuple(self.plugins))
        _require(bool(self.shards) != bool(self.datasets),
                 "give shards or datasets (a mixture), not both" if self.shards else
                 "shards is empty: give at least one shard path or URL (or datasets)")
        self._check_mixture()
        for name, (low, high) in self.BOUNDS.items():
            _in_range(name, getattr(self, name), low, high)
        _in_range("enc_shared_by", self.enc_shared_by, 1, self.dp_size)
        _in_range("gen_shared_by", self.gen_shared_by, 1, self.dp_size)
        _in_range("enc_split_by", self.enc_split_by, 1, MAX_SPLIT)
        _in_range("gen_split_by", self.gen_split_by, 1, MAX_SPLIT)
        _in_range("max_error_fraction", self.max_error_fraction, 1e-9, 1.0, integer=False)
        _require(self.global_batch <= MAX_GLOBAL_BATCH,
                 f"dp_size x num_microbatches x seqs_per_microbatch = {self.global_batch} sequences per step, "
                 f"more than {MAX_GLOBAL_BATCH}")
        _require(len(self.stage_map) <= MAX_STAGES and all(isinstance(s, str) and len(s) <= 32 for s in self.stage_map),
                 f"stage_map may hold at most {MAX_STAGES} stages of at most 32 characters each")
        _require(isinstance(self.reorder_algorithm, str) and PLANNER_NAME.fullmatch(self.reorder_algorithm) is not None,
                 f"reorder_algorithm {self.reorder_algorithm!r} is not a planner's name (lowercase letters, digits, "
                 f"'-' and '_', at most 32)")
        try:
            model = self.stage_model()
        except ValueError as exc:
            raise ConfigError(f"stage_map {list(self.stage_map)}: {exc}") from None
        try:
            model.check_ranks(self.dp_size)
        except ValueError as exc:
            raise ConfigError(f"enc_shared_by / gen_shared_by: {exc}") from None

    def _check_mixture(self) -> None:
        _require(len(self.datasets) <= MAX_DATASETS, f"at most {MAX_DATASETS} datasets, got {len(self.datasets)}")
        _require(all(isinstance(d, DatasetConfig) for d in self.datasets), "datasets must be DatasetConfigs")
        names = [d.name for d in self.datasets]
        _require(len(set(names)) == len(names), f"dataset names must be distinct, got {names}")
        for d in self.datasets:  # one encoder: its patches and token merging are the job's
            _require(d.image is None or (d.image.patch_size, d.image.merge_size) ==
                     (self.image.patch_size, self.image.merge_size),
                     f"dataset {d.name!r}: image.patch_size and image.merge_size must be the job's "
                     f"({self.image.patch_size}, {self.image.merge_size}): one encoder reads every dataset")
        _require(self.manifests in MANIFESTS, f"manifests must be one of {list(MANIFESTS)}, got {self.manifests!r}")
        _require(self.dedup in DEDUP, f"dedup must be one of {list(DEDUP)}, got {self.dedup!r}")
        _require(self.mix_by in MIX_BY, f"mix_by must be one of {list(MIX_BY)}, got {self.mix_by!r}")
        _require(self.mix_epoch in MIX_EPOCH, f"mix_epoch must be one of {list(MIX_EPOCH)}, got {self.mix_epoch!r}")
        _in_range("mix_epoch_samples", self.mix_epoch_samples, 0, 1 << 40)
        _require(len(self.plugins) <= MAX_PLUGINS and all(isinstance(p, PluginConfig) for p in self.plugins),
                 f"plugins must be at most {MAX_PLUGINS} PluginConfigs")
        names = [p.name for p in self.plugins]
        _require(len(set(names)) == len(names), f"plugin names must be distinct, got {names}")
        _require(isinstance(self.tokenizer, str) and 0 < len(self.tokenizer) <= 4096,
                 f"tokenizer must be 'byte', hf:PATH or sentencepiece:PATH (at most 4096 characters), "
                 f"got {self.tokenizer!r:.80}")

    def mixture(self) -> tuple[DatasetConfig, ...]:
        """The job's datasets: its ``datasets``, or one dataset named "default" of its ``shards``."""
        return self.datasets or (DatasetConfig(name="default", shards=self.shards),)

    def stage_model(self):
        """The simulator's model of one DP rank's pipeline (simulate.StageModel)."""
        if not self.stage_map:
            raise ValueError("at least one stage is needed")
        cost = self.cost
        return StageModel(stage_map=self.stage_map,
                          bwd_factor=(0.0 if cost.enc_frozen else cost.enc_backward_factor,
                                      cost.bb_backward_factor, cost.gen_backward_factor),
                          shared_by=(self.enc_shared_by, 1, self.gen_shared_by),
                          split_by=(self.enc_split_by, 1, self.gen_split_by))

    def max_microbatch_bytes(self, video: bool = True) -> int:
        """An upper bound on one microbatch's tensor bytes, from the config alone: every token at
        its costliest (int32 id and position, a modality byte, plus the pixels or mel frames that
        token can stand for). The service refuses a job whose bound exceeds its limit."""
        image = max(cfg.factor for cfg in (self.image, *(d.image for d in self.datasets if d.image))) ** 2 * 3
        audio = self.audio.token_stride * self.audio.n_mels * 2
        generated = -(-self.generation.image_size ** 2 * 3 // self.generation.query_tokens)
        video_bytes = self.video.temporal_patch * self.image.factor ** 2 * 3  # one token: a patch of each frame
        per_token = 9 + max(image, audio, generated, video_bytes if video else 0) + 16  # + spans and boundaries
        return self.seqs_per_microbatch * self.seq_len * per_token

    @property
    def global_batch(self) -> int:
        """Sequences per step."""
        return self.dp_size * self.num_microbatches * self.seqs_per_microbatch

    @property
    def shards_open(self) -> int:
        """open_shards with its default resolved."""
        return self.open_shards or (16 if self.shard_shuffle else 1)

    LAYOUT_FIELDS = ("dp_size", "num_microbatches", "seqs_per_microbatch", "reorder_algorithm", "stage_map",
                     "enc_shared_by", "gen_shared_by", "enc_split_by", "gen_split_by")
    """What a job's sequences do not depend on, only their grouping into steps and ranks: a job
    checkpointed with one value resumes with another (elastic resume) within its lineage."""

    PRICING_FIELDS = ("cost", "cost_feedback")
    """What prices the sequences, not what they hold (a restarted trainer may measure new costs)."""

    def lineage_id(self) -> str:
        """A hash of the config without LAYOUT_FIELDS and PRICING_FIELDS: jobs of one lineage plan
        the same sequences."""
        data = {k: v for k, v in self.to_dict().items() if k not in (*self.LAYOUT_FIELDS, *self.PRICING_FIELDS)}
        blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return "lineage-" + hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def job_id(self) -> str:
        """Stable id: a hash of the normalised config, so ranks sending the same config share a job."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return "job-" + hashlib.sha256(blob.encode()).hexdigest()[:16]


def field_help(cls) -> dict[str, str]:
    """{field: its docstring} of a config dataclass, read from this module's source: the help text
    every CLI and the proto comments take from here (the one definition of a job's fields)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(cls))
    body = cast(ast.ClassDef, tree.body[0]).body  # the source of a class is one class statement
    out = {}
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant) \
                and isinstance(following.value.value, str):
            out[node.target.id] = " ".join(following.value.value.split())
    return out


def field_defaults(cls) -> dict:
    """{field: default} of a config dataclass (fields without a default are left out)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out
