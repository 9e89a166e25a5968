from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    INT16: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
UINT8: DType
INT16: DType
INT32: DType
INT64: DType
FLOAT16: DType
FLOAT32: DType

class ImageSpec(_message.Message):
    __slots__ = ("patch_size", "merge_size", "max_pixels", "min_pixels", "max_source_pixels")
    PATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MERGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MIN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_SOURCE_PIXELS_FIELD_NUMBER: _ClassVar[int]
    patch_size: int
    merge_size: int
    max_pixels: int
    min_pixels: int
    max_source_pixels: int
    def __init__(self, patch_size: _Optional[int] = ..., merge_size: _Optional[int] = ..., max_pixels: _Optional[int] = ..., min_pixels: _Optional[int] = ..., max_source_pixels: _Optional[int] = ...) -> None: ...

class VideoSpec(_message.Message):
    __slots__ = ("fps", "max_frames", "temporal_patch", "max_pixels", "max_source_pixels", "max_seconds", "max_decoded_frames", "max_decoded_pixels")
    FPS_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    TEMPORAL_PATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_SOURCE_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_DECODED_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_DECODED_PIXELS_FIELD_NUMBER: _ClassVar[int]
    fps: float
    max_frames: int
    temporal_patch: int
    max_pixels: int
    max_source_pixels: int
    max_seconds: float
    max_decoded_frames: int
    max_decoded_pixels: int
    def __init__(self, fps: _Optional[float] = ..., max_frames: _Optional[int] = ..., temporal_patch: _Optional[int] = ..., max_pixels: _Optional[int] = ..., max_source_pixels: _Optional[int] = ..., max_seconds: _Optional[float] = ..., max_decoded_frames: _Optional[int] = ..., max_decoded_pixels: _Optional[int] = ...) -> None: ...

class AudioSpec(_message.Message):
    __slots__ = ("sample_rate", "n_mels", "n_fft", "hop_length", "token_stride", "max_seconds")
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    N_MELS_FIELD_NUMBER: _ClassVar[int]
    N_FFT_FIELD_NUMBER: _ClassVar[int]
    HOP_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRIDE_FIELD_NUMBER: _ClassVar[int]
    MAX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    sample_rate: int
    n_mels: int
    n_fft: int
    hop_length: int
    token_stride: int
    max_seconds: float
    def __init__(self, sample_rate: _Optional[int] = ..., n_mels: _Optional[int] = ..., n_fft: _Optional[int] = ..., hop_length: _Optional[int] = ..., token_stride: _Optional[int] = ..., max_seconds: _Optional[float] = ...) -> None: ...

class GenerationSpec(_message.Message):
    __slots__ = ("image_size", "query_tokens", "select")
    IMAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SELECT_FIELD_NUMBER: _ClassVar[int]
    image_size: int
    query_tokens: int
    select: str
    def __init__(self, image_size: _Optional[int] = ..., query_tokens: _Optional[int] = ..., select: _Optional[str] = ...) -> None: ...

class CostSpec(_message.Message):
    __slots__ = ("enc_linear_s", "enc_quadratic_s", "bb_linear_s", "bb_quadratic_s", "gen_per_image_s", "enc_backward_factor", "bb_backward_factor", "gen_backward_factor", "enc_frozen")
    ENC_LINEAR_S_FIELD_NUMBER: _ClassVar[int]
    ENC_QUADRATIC_S_FIELD_NUMBER: _ClassVar[int]
    BB_LINEAR_S_FIELD_NUMBER: _ClassVar[int]
    BB_QUADRATIC_S_FIELD_NUMBER: _ClassVar[int]
    GEN_PER_IMAGE_S_FIELD_NUMBER: _ClassVar[int]
    ENC_BACKWARD_FACTOR_FIELD_NUMBER: _ClassVar[int]
    BB_BACKWARD_FACTOR_FIELD_NUMBER: _ClassVar[int]
    GEN_BACKWARD_FACTOR_FIELD_NUMBER: _ClassVar[int]
    ENC_FROZEN_FIELD_NUMBER: _ClassVar[int]
    enc_linear_s: float
    enc_quadratic_s: float
    bb_linear_s: float
    bb_quadratic_s: float
    gen_per_image_s: float
    enc_backward_factor: float
    bb_backward_factor: float
    gen_backward_factor: float
    enc_frozen: bool
    def __init__(self, enc_linear_s: _Optional[float] = ..., enc_quadratic_s: _Optional[float] = ..., bb_linear_s: _Optional[float] = ..., bb_quadratic_s: _Optional[float] = ..., gen_per_image_s: _Optional[float] = ..., enc_backward_factor: _Optional[float] = ..., bb_backward_factor: _Optional[float] = ..., gen_backward_factor: _Optional[float] = ..., enc_frozen: _Optional[bool] = ...) -> None: ...

class DatasetSpec(_message.Message):
    __slots__ = ("name", "shards", "weight", "modalities", "image", "generate")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MODALITIES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shards: _containers.RepeatedScalarFieldContainer[str]
    weight: float
    modalities: _containers.RepeatedScalarFieldContainer[str]
    image: ImageSpec
    generate: str
    def __init__(self, name: _Optional[str] = ..., shards: _Optional[_Iterable[str]] = ..., weight: _Optional[float] = ..., modalities: _Optional[_Iterable[str]] = ..., image: _Optional[_Union[ImageSpec, _Mapping]] = ..., generate: _Optional[str] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("shards", "seq_len", "dp_size", "num_microbatches", "seqs_per_microbatch", "seed", "num_epochs", "shuffle_buffer", "no_shard_shuffle", "pack_window", "image", "cost", "reorder_algorithm", "stage_map", "enc_shared_by", "gen_shared_by", "enc_split_by", "gen_split_by", "audio", "generation", "cost_feedback", "max_consecutive_errors", "max_error_fraction", "tokenizer", "datasets", "mix_by", "mix_epoch", "mix_epoch_samples", "open_shards", "dedup", "manifests", "plugins", "video")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    SEQS_PER_MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_BUFFER_FIELD_NUMBER: _ClassVar[int]
    NO_SHARD_SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    PACK_WINDOW_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    REORDER_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    STAGE_MAP_FIELD_NUMBER: _ClassVar[int]
    ENC_SHARED_BY_FIELD_NUMBER: _ClassVar[int]
    GEN_SHARED_BY_FIELD_NUMBER: _ClassVar[int]
    ENC_SPLIT_BY_FIELD_NUMBER: _ClassVar[int]
    GEN_SPLIT_BY_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    COST_FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    MAX_CONSECUTIVE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    MAX_ERROR_FRACTION_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    MIX_BY_FIELD_NUMBER: _ClassVar[int]
    MIX_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MIX_EPOCH_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    OPEN_SHARDS_FIELD_NUMBER: _ClassVar[int]
    DEDUP_FIELD_NUMBER: _ClassVar[int]
    MANIFESTS_FIELD_NUMBER: _ClassVar[int]
    PLUGINS_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedScalarFieldContainer[str]
    seq_len: int
    dp_size: int
    num_microbatches: int
    seqs_per_microbatch: int
    seed: int
    num_epochs: int
    shuffle_buffer: int
    no_shard_shuffle: bool
    pack_window: int
    image: ImageSpec
    cost: CostSpec
    reorder_algorithm: str
    stage_map: _containers.RepeatedScalarFieldContainer[str]
    enc_shared_by: int
    gen_shared_by: int
    enc_split_by: int
    gen_split_by: int
    audio: AudioSpec
    generation: GenerationSpec
    cost_feedback: bool
    max_consecutive_errors: int
    max_error_fraction: float
    tokenizer: str
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetSpec]
    mix_by: str
    mix_epoch: str
    mix_epoch_samples: int
    open_shards: int
    dedup: str
    manifests: str
    plugins: _containers.RepeatedCompositeFieldContainer[PluginSpec]
    video: VideoSpec
    def __init__(self, shards: _Optional[_Iterable[str]] = ..., seq_len: _Optional[int] = ..., dp_size: _Optional[int] = ..., num_microbatches: _Optional[int] = ..., seqs_per_microbatch: _Optional[int] = ..., seed: _Optional[int] = ..., num_epochs: _Optional[int] = ..., shuffle_buffer: _Optional[int] = ..., no_shard_shuffle: _Optional[bool] = ..., pack_window: _Optional[int] = ..., image: _Optional[_Union[ImageSpec, _Mapping]] = ..., cost: _Optional[_Union[CostSpec, _Mapping]] = ..., reorder_algorithm: _Optional[str] = ..., stage_map: _Optional[_Iterable[str]] = ..., enc_shared_by: _Optional[int] = ..., gen_shared_by: _Optional[int] = ..., enc_split_by: _Optional[int] = ..., gen_split_by: _Optional[int] = ..., audio: _Optional[_Union[AudioSpec, _Mapping]] = ..., generation: _Optional[_Union[GenerationSpec, _Mapping]] = ..., cost_feedback: _Optional[bool] = ..., max_consecutive_errors: _Optional[int] = ..., max_error_fraction: _Optional[float] = ..., tokenizer: _Optional[str] = ..., datasets: _Optional[_Iterable[_Union[DatasetSpec, _Mapping]]] = ..., mix_by: _Optional[str] = ..., mix_epoch: _Optional[str] = ..., mix_epoch_samples: _Optional[int] = ..., open_shards: _Optional[int] = ..., dedup: _Optional[str] = ..., manifests: _Optional[str] = ..., plugins: _Optional[_Iterable[_Union[PluginSpec, _Mapping]]] = ..., video: _Optional[_Union[VideoSpec, _Mapping]] = ...) -> None: ...

class PluginSpec(_message.Message):
    __slots__ = ("name", "params_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    params_json: str
    def __init__(self, name: _Optional[str] = ..., params_json: _Optional[str] = ...) -> None: ...

class TokenizerInfo(_message.Message):
    __slots__ = ("kind", "vocab_size", "pad_id", "bos_id", "eos_id", "image_id", "audio_id", "gen_id", "sha256", "added_tokens")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAD_ID_FIELD_NUMBER: _ClassVar[int]
    BOS_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_ID_FIELD_NUMBER: _ClassVar[int]
    AUDIO_ID_FIELD_NUMBER: _ClassVar[int]
    GEN_ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    ADDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int
    image_id: int
    audio_id: int
    gen_id: int
    sha256: str
    added_tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, kind: _Optional[str] = ..., vocab_size: _Optional[int] = ..., pad_id: _Optional[int] = ..., bos_id: _Optional[int] = ..., eos_id: _Optional[int] = ..., image_id: _Optional[int] = ..., audio_id: _Optional[int] = ..., gen_id: _Optional[int] = ..., sha256: _Optional[str] = ..., added_tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class CloseJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CloseJobResponse(_message.Message):
    __slots__ = ("num_streams_closed",)
    NUM_STREAMS_CLOSED_FIELD_NUMBER: _ClassVar[int]
    num_streams_closed: int
    def __init__(self, num_streams_closed: _Optional[int] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JobSummary(_message.Message):
    __slots__ = ("job_id", "dp_size", "num_microbatches", "seq_len", "datasets", "num_planned_steps", "planning_done", "num_sent_microbatches", "acknowledged_step", "num_streams", "clients", "num_skipped", "idle_s", "warnings")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    NUM_PLANNED_STEPS_FIELD_NUMBER: _ClassVar[int]
    PLANNING_DONE_FIELD_NUMBER: _ClassVar[int]
    NUM_SENT_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    ACKNOWLEDGED_STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_STREAMS_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    dp_size: int
    num_microbatches: int
    seq_len: int
    datasets: _containers.RepeatedScalarFieldContainer[str]
    num_planned_steps: int
    planning_done: bool
    num_sent_microbatches: int
    acknowledged_step: int
    num_streams: int
    clients: _containers.RepeatedScalarFieldContainer[str]
    num_skipped: int
    idle_s: float
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., dp_size: _Optional[int] = ..., num_microbatches: _Optional[int] = ..., seq_len: _Optional[int] = ..., datasets: _Optional[_Iterable[str]] = ..., num_planned_steps: _Optional[int] = ..., planning_done: _Optional[bool] = ..., num_sent_microbatches: _Optional[int] = ..., acknowledged_step: _Optional[int] = ..., num_streams: _Optional[int] = ..., clients: _Optional[_Iterable[str]] = ..., num_skipped: _Optional[int] = ..., idle_s: _Optional[float] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobSummary]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobSummary, _Mapping]]] = ...) -> None: ...

class OpenJobRequest(_message.Message):
    __slots__ = ("spec", "continue_at_step")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_AT_STEP_FIELD_NUMBER: _ClassVar[int]
    spec: JobSpec
    continue_at_step: int
    def __init__(self, spec: _Optional[_Union[JobSpec, _Mapping]] = ..., continue_at_step: _Optional[int] = ...) -> None: ...

class DescribeJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("job_id", "spec", "global_batch_sequences", "num_steps", "shard_urls", "tokenizer", "num_shards")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    SHARD_URLS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    spec: JobSpec
    global_batch_sequences: int
    num_steps: int
    shard_urls: _containers.RepeatedScalarFieldContainer[str]
    tokenizer: TokenizerInfo
    num_shards: int
    def __init__(self, job_id: _Optional[str] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., global_batch_sequences: _Optional[int] = ..., num_steps: _Optional[int] = ..., shard_urls: _Optional[_Iterable[str]] = ..., tokenizer: _Optional[_Union[TokenizerInfo, _Mapping]] = ..., num_shards: _Optional[int] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("job_id", "dp_rank", "start_step", "start_microbatch", "max_steps", "shm_probe", "shm_probe_token")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    START_MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    SHM_PROBE_FIELD_NUMBER: _ClassVar[int]
    SHM_PROBE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    dp_rank: int
    start_step: int
    start_microbatch: int
    max_steps: int
    shm_probe: str
    shm_probe_token: bytes
    def __init__(self, job_id: _Optional[str] = ..., dp_rank: _Optional[int] = ..., start_step: _Optional[int] = ..., start_microbatch: _Optional[int] = ..., max_steps: _Optional[int] = ..., shm_probe: _Optional[str] = ..., shm_probe_token: _Optional[bytes] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data", "shm_offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    shm_offset: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., shm_offset: _Optional[int] = ...) -> None: ...

class SequenceCost(_message.Message):
    __slots__ = ("encoder_s", "backbone_s", "generator_s", "total_s")
    ENCODER_S_FIELD_NUMBER: _ClassVar[int]
    BACKBONE_S_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    encoder_s: float
    backbone_s: float
    generator_s: float
    total_s: float
    def __init__(self, encoder_s: _Optional[float] = ..., backbone_s: _Optional[float] = ..., generator_s: _Optional[float] = ..., total_s: _Optional[float] = ...) -> None: ...

class SkippedSample(_message.Message):
    __slots__ = ("key", "shard", "reason", "kind")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    key: str
    shard: str
    reason: str
    kind: str
    def __init__(self, key: _Optional[str] = ..., shard: _Optional[str] = ..., reason: _Optional[str] = ..., kind: _Optional[str] = ...) -> None: ...

class Microbatch(_message.Message):
    __slots__ = ("job_id", "step", "dp_rank", "microbatch_index", "num_microbatches", "tensors", "sample_keys", "sequence_costs", "skipped", "epoch", "sample_datasets", "shm_name", "shm_nbytes", "shm_token")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_KEYS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_COSTS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_DATASETS_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    dp_rank: int
    microbatch_index: int
    num_microbatches: int
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    sample_keys: _containers.RepeatedScalarFieldContainer[str]
    sequence_costs: _containers.RepeatedCompositeFieldContainer[SequenceCost]
    skipped: _containers.RepeatedCompositeFieldContainer[SkippedSample]
    epoch: int
    sample_datasets: _containers.RepeatedScalarFieldContainer[int]
    shm_name: str
    shm_nbytes: int
    shm_token: bytes
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., dp_rank: _Optional[int] = ..., microbatch_index: _Optional[int] = ..., num_microbatches: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., sample_keys: _Optional[_Iterable[str]] = ..., sequence_costs: _Optional[_Iterable[_Union[SequenceCost, _Mapping]]] = ..., skipped: _Optional[_Iterable[_Union[SkippedSample, _Mapping]]] = ..., epoch: _Optional[int] = ..., sample_datasets: _Optional[_Iterable[int]] = ..., shm_name: _Optional[str] = ..., shm_nbytes: _Optional[int] = ..., shm_token: _Optional[bytes] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("job_id", "dp_rank", "next_step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    dp_rank: int
    next_step: int
    def __init__(self, job_id: _Optional[str] = ..., dp_rank: _Optional[int] = ..., next_step: _Optional[int] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("min_next_step",)
    MIN_NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    min_next_step: int
    def __init__(self, min_next_step: _Optional[int] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class JobReport(_message.Message):
    __slots__ = ("job_id", "skipped", "num_planned_samples", "num_planned_steps", "planning_done", "num_sent_microbatches", "step_balance", "failure", "datasets", "plugins")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_PLANNED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_PLANNED_STEPS_FIELD_NUMBER: _ClassVar[int]
    PLANNING_DONE_FIELD_NUMBER: _ClassVar[int]
    NUM_SENT_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    STEP_BALANCE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    PLUGINS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    skipped: _containers.RepeatedCompositeFieldContainer[SkippedSample]
    num_planned_samples: int
    num_planned_steps: int
    planning_done: bool
    num_sent_microbatches: int
    step_balance: _containers.RepeatedCompositeFieldContainer[StepBalance]
    failure: str
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetCount]
    plugins: _containers.RepeatedCompositeFieldContainer[PluginCost]
    def __init__(self, job_id: _Optional[str] = ..., skipped: _Optional[_Iterable[_Union[SkippedSample, _Mapping]]] = ..., num_planned_samples: _Optional[int] = ..., num_planned_steps: _Optional[int] = ..., planning_done: _Optional[bool] = ..., num_sent_microbatches: _Optional[int] = ..., step_balance: _Optional[_Iterable[_Union[StepBalance, _Mapping]]] = ..., failure: _Optional[str] = ..., datasets: _Optional[_Iterable[_Union[DatasetCount, _Mapping]]] = ..., plugins: _Optional[_Iterable[_Union[PluginCost, _Mapping]]] = ...) -> None: ...

class PluginCost(_message.Message):
    __slots__ = ("plugin", "hook", "cpu_s", "calls")
    PLUGIN_FIELD_NUMBER: _ClassVar[int]
    HOOK_FIELD_NUMBER: _ClassVar[int]
    CPU_S_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    plugin: str
    hook: str
    cpu_s: float
    calls: int
    def __init__(self, plugin: _Optional[str] = ..., hook: _Optional[str] = ..., cpu_s: _Optional[float] = ..., calls: _Optional[int] = ...) -> None: ...

class DatasetCount(_message.Message):
    __slots__ = ("name", "num_samples", "num_tokens", "epoch_samples", "restarts")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_samples: int
    num_tokens: int
    epoch_samples: int
    restarts: int
    def __init__(self, name: _Optional[str] = ..., num_samples: _Optional[int] = ..., num_tokens: _Optional[int] = ..., epoch_samples: _Optional[int] = ..., restarts: _Optional[int] = ...) -> None: ...

class StepBalance(_message.Message):
    __slots__ = ("step", "imbalance", "arrival_imbalance", "rank_load_s", "num_sequences", "num_samples", "iteration_s", "arrival_iteration_s", "lower_bound_s", "bubble_fraction")
    STEP_FIELD_NUMBER: _ClassVar[int]
    IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    RANK_LOAD_S_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ITERATION_S_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_ITERATION_S_FIELD_NUMBER: _ClassVar[int]
    LOWER_BOUND_S_FIELD_NUMBER: _ClassVar[int]
    BUBBLE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    step: int
    imbalance: float
    arrival_imbalance: float
    rank_load_s: _containers.RepeatedScalarFieldContainer[float]
    num_sequences: int
    num_samples: int
    iteration_s: float
    arrival_iteration_s: float
    lower_bound_s: float
    bubble_fraction: float
    def __init__(self, step: _Optional[int] = ..., imbalance: _Optional[float] = ..., arrival_imbalance: _Optional[float] = ..., rank_load_s: _Optional[_Iterable[float]] = ..., num_sequences: _Optional[int] = ..., num_samples: _Optional[int] = ..., iteration_s: _Optional[float] = ..., arrival_iteration_s: _Optional[float] = ..., lower_bound_s: _Optional[float] = ..., bubble_fraction: _Optional[float] = ...) -> None: ...

class MicrobatchTiming(_message.Message):
    __slots__ = ("step", "dp_rank", "microbatch_index", "encoder_s", "backbone_s", "generator_s", "total_s")
    STEP_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    ENCODER_S_FIELD_NUMBER: _ClassVar[int]
    BACKBONE_S_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    step: int
    dp_rank: int
    microbatch_index: int
    encoder_s: float
    backbone_s: float
    generator_s: float
    total_s: float
    def __init__(self, step: _Optional[int] = ..., dp_rank: _Optional[int] = ..., microbatch_index: _Optional[int] = ..., encoder_s: _Optional[float] = ..., backbone_s: _Optional[float] = ..., generator_s: _Optional[float] = ..., total_s: _Optional[float] = ...) -> None: ...

class TimingReport(_message.Message):
    __slots__ = ("job_id", "timings", "bubble_step", "bubble_fraction", "has_bubble")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    BUBBLE_STEP_FIELD_NUMBER: _ClassVar[int]
    BUBBLE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    HAS_BUBBLE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    timings: _containers.RepeatedCompositeFieldContainer[MicrobatchTiming]
    bubble_step: int
    bubble_fraction: float
    has_bubble: bool
    def __init__(self, job_id: _Optional[str] = ..., timings: _Optional[_Iterable[_Union[MicrobatchTiming, _Mapping]]] = ..., bubble_step: _Optional[int] = ..., bubble_fraction: _Optional[float] = ..., has_bubble: _Optional[bool] = ...) -> None: ...

class TimingAck(_message.Message):
    __slots__ = ("cost", "num_observations", "first_step_priced", "encoder_rel_error", "backbone_rel_error", "generator_rel_error", "total_rel_error")
    COST_FIELD_NUMBER: _ClassVar[int]
    NUM_OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_PRICED_FIELD_NUMBER: _ClassVar[int]
    ENCODER_REL_ERROR_FIELD_NUMBER: _ClassVar[int]
    BACKBONE_REL_ERROR_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_REL_ERROR_FIELD_NUMBER: _ClassVar[int]
    TOTAL_REL_ERROR_FIELD_NUMBER: _ClassVar[int]
    cost: CostSpec
    num_observations: int
    first_step_priced: int
    encoder_rel_error: float
    backbone_rel_error: float
    generator_rel_error: float
    total_rel_error: float
    def __init__(self, cost: _Optional[_Union[CostSpec, _Mapping]] = ..., num_observations: _Optional[int] = ..., first_step_priced: _Optional[int] = ..., encoder_rel_error: _Optional[float] = ..., backbone_rel_error: _Optional[float] = ..., generator_rel_error: _Optional[float] = ..., total_rel_error: _Optional[float] = ...) -> None: ...
