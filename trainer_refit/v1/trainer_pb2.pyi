from trainer_refit.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LossKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOSS_KIND_UNSPECIFIED: _ClassVar[LossKind]
    LOSS_KIND_CROSS_ENTROPY: _ClassVar[LossKind]
    LOSS_KIND_PPO: _ClassVar[LossKind]
    LOSS_KIND_GSPO: _ClassVar[LossKind]
    LOSS_KIND_CISPO: _ClassVar[LossKind]

class Normalization(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NORMALIZATION_UNSPECIFIED: _ClassVar[Normalization]
    NORMALIZATION_TOKEN: _ClassVar[Normalization]
    NORMALIZATION_SEQUENCE: _ClassVar[Normalization]
    NORMALIZATION_CONSTANT: _ClassVar[Normalization]

class Correction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CORRECTION_UNSPECIFIED: _ClassVar[Correction]
    CORRECTION_TIS: _ClassVar[Correction]
    CORRECTION_ICEPOP: _ClassVar[Correction]

class ReferenceSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REFERENCE_SOURCE_UNSPECIFIED: _ClassVar[ReferenceSource]
    REFERENCE_SOURCE_SERVICE: _ClassVar[ReferenceSource]

class CorrectionLevel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CORRECTION_LEVEL_UNSPECIFIED: _ClassVar[CorrectionLevel]
    CORRECTION_LEVEL_SEQUENCE: _ClassVar[CorrectionLevel]

class StaleData(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STALE_DATA_UNSPECIFIED: _ClassVar[StaleData]
    STALE_DATA_MASK: _ClassVar[StaleData]

class StepGradient(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_GRADIENT_UNSPECIFIED: _ClassVar[StepGradient]
    STEP_GRADIENT_NONZERO: _ClassVar[StepGradient]
    STEP_GRADIENT_ZERO: _ClassVar[StepGradient]

class PublicationState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUBLICATION_STATE_UNSPECIFIED: _ClassVar[PublicationState]
    PUBLICATION_STATE_PENDING: _ClassVar[PublicationState]
    PUBLICATION_STATE_RETRYING: _ClassVar[PublicationState]
    PUBLICATION_STATE_READABLE: _ClassVar[PublicationState]
    PUBLICATION_STATE_FAILED: _ClassVar[PublicationState]
    PUBLICATION_STATE_NOT_PUBLISHED: _ClassVar[PublicationState]

class ForwardOutput(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FORWARD_OUTPUT_UNSPECIFIED: _ClassVar[ForwardOutput]
    FORWARD_OUTPUT_LOGPROBS: _ClassVar[ForwardOutput]
    FORWARD_OUTPUT_TOP_K: _ClassVar[ForwardOutput]
    FORWARD_OUTPUT_ENTROPY: _ClassVar[ForwardOutput]
    FORWARD_OUTPUT_REFERENCE_LOGPROBS: _ClassVar[ForwardOutput]
    FORWARD_OUTPUT_ROUTED_EXPERTS: _ClassVar[ForwardOutput]

class ExportDType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXPORT_DTYPE_UNSPECIFIED: _ClassVar[ExportDType]
    EXPORT_DTYPE_BFLOAT16: _ClassVar[ExportDType]
    EXPORT_DTYPE_FLOAT32: _ClassVar[ExportDType]
    EXPORT_DTYPE_PARAMS: _ClassVar[ExportDType]
LOSS_KIND_UNSPECIFIED: LossKind
LOSS_KIND_CROSS_ENTROPY: LossKind
LOSS_KIND_PPO: LossKind
LOSS_KIND_GSPO: LossKind
LOSS_KIND_CISPO: LossKind
NORMALIZATION_UNSPECIFIED: Normalization
NORMALIZATION_TOKEN: Normalization
NORMALIZATION_SEQUENCE: Normalization
NORMALIZATION_CONSTANT: Normalization
CORRECTION_UNSPECIFIED: Correction
CORRECTION_TIS: Correction
CORRECTION_ICEPOP: Correction
REFERENCE_SOURCE_UNSPECIFIED: ReferenceSource
REFERENCE_SOURCE_SERVICE: ReferenceSource
CORRECTION_LEVEL_UNSPECIFIED: CorrectionLevel
CORRECTION_LEVEL_SEQUENCE: CorrectionLevel
STALE_DATA_UNSPECIFIED: StaleData
STALE_DATA_MASK: StaleData
STEP_GRADIENT_UNSPECIFIED: StepGradient
STEP_GRADIENT_NONZERO: StepGradient
STEP_GRADIENT_ZERO: StepGradient
PUBLICATION_STATE_UNSPECIFIED: PublicationState
PUBLICATION_STATE_PENDING: PublicationState
PUBLICATION_STATE_RETRYING: PublicationState
PUBLICATION_STATE_READABLE: PublicationState
PUBLICATION_STATE_FAILED: PublicationState
PUBLICATION_STATE_NOT_PUBLISHED: PublicationState
FORWARD_OUTPUT_UNSPECIFIED: ForwardOutput
FORWARD_OUTPUT_LOGPROBS: ForwardOutput
FORWARD_OUTPUT_TOP_K: ForwardOutput
FORWARD_OUTPUT_ENTROPY: ForwardOutput
FORWARD_OUTPUT_REFERENCE_LOGPROBS: ForwardOutput
FORWARD_OUTPUT_ROUTED_EXPERTS: ForwardOutput
EXPORT_DTYPE_UNSPECIFIED: ExportDType
EXPORT_DTYPE_BFLOAT16: ExportDType
EXPORT_DTYPE_FLOAT32: ExportDType
EXPORT_DTYPE_PARAMS: ExportDType

class SetReferenceRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetReferenceResponse(_message.Message):
    __slots__ = ("weights_version",)
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    weights_version: int
    def __init__(self, weights_version: _Optional[int] = ...) -> None: ...

class Sequences(_message.Message):
    __slots__ = ("tokens", "offsets")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class LossConfig(_message.Message):
    __slots__ = ("kind", "normalization", "clip_low", "clip_high", "kl_coef", "dual_clip", "entropy_coef", "normalization_length", "correction", "correction_level", "tis_cap", "icepop_low", "icepop_high", "reference_source")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NORMALIZATION_FIELD_NUMBER: _ClassVar[int]
    CLIP_LOW_FIELD_NUMBER: _ClassVar[int]
    CLIP_HIGH_FIELD_NUMBER: _ClassVar[int]
    KL_COEF_FIELD_NUMBER: _ClassVar[int]
    DUAL_CLIP_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_COEF_FIELD_NUMBER: _ClassVar[int]
    NORMALIZATION_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CORRECTION_FIELD_NUMBER: _ClassVar[int]
    CORRECTION_LEVEL_FIELD_NUMBER: _ClassVar[int]
    TIS_CAP_FIELD_NUMBER: _ClassVar[int]
    ICEPOP_LOW_FIELD_NUMBER: _ClassVar[int]
    ICEPOP_HIGH_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    kind: LossKind
    normalization: Normalization
    clip_low: float
    clip_high: float
    kl_coef: float
    dual_clip: float
    entropy_coef: float
    normalization_length: int
    correction: Correction
    correction_level: CorrectionLevel
    tis_cap: float
    icepop_low: float
    icepop_high: float
    reference_source: ReferenceSource
    def __init__(self, kind: _Optional[_Union[LossKind, str]] = ..., normalization: _Optional[_Union[Normalization, str]] = ..., clip_low: _Optional[float] = ..., clip_high: _Optional[float] = ..., kl_coef: _Optional[float] = ..., dual_clip: _Optional[float] = ..., entropy_coef: _Optional[float] = ..., normalization_length: _Optional[int] = ..., correction: _Optional[_Union[Correction, str]] = ..., correction_level: _Optional[_Union[CorrectionLevel, str]] = ..., tis_cap: _Optional[float] = ..., icepop_low: _Optional[float] = ..., icepop_high: _Optional[float] = ..., reference_source: _Optional[_Union[ReferenceSource, str]] = ...) -> None: ...

class OptimizerParams(_message.Message):
    __slots__ = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "max_grad_norm")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    ADAM_BETA1_FIELD_NUMBER: _ClassVar[int]
    ADAM_BETA2_FIELD_NUMBER: _ClassVar[int]
    ADAM_EPS_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    max_grad_norm: float
    def __init__(self, learning_rate: _Optional[float] = ..., weight_decay: _Optional[float] = ..., adam_beta1: _Optional[float] = ..., adam_beta2: _Optional[float] = ..., adam_eps: _Optional[float] = ..., max_grad_norm: _Optional[float] = ...) -> None: ...

class BeginTrainStepRequest(_message.Message):
    __slots__ = ("step_id", "loss", "optimizer", "max_staleness", "stale_data")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    STALE_DATA_FIELD_NUMBER: _ClassVar[int]
    step_id: str
    loss: LossConfig
    optimizer: OptimizerParams
    max_staleness: int
    stale_data: StaleData
    def __init__(self, step_id: _Optional[str] = ..., loss: _Optional[_Union[LossConfig, _Mapping]] = ..., optimizer: _Optional[_Union[OptimizerParams, _Mapping]] = ..., max_staleness: _Optional[int] = ..., stale_data: _Optional[_Union[StaleData, str]] = ...) -> None: ...

class BeginTrainStepResponse(_message.Message):
    __slots__ = ("step_id", "weights_version")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    step_id: str
    weights_version: int
    def __init__(self, step_id: _Optional[str] = ..., weights_version: _Optional[int] = ...) -> None: ...

class TrainMicrobatchRequest(_message.Message):
    __slots__ = ("step_id", "request_id", "sequences", "loss_mask", "advantages", "behaviour_logprobs", "reference_logprobs", "sampler_logprobs", "weights_versions", "weights_version_spans", "routed_experts")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOUR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    step_id: str
    request_id: str
    sequences: Sequences
    loss_mask: _containers.RepeatedScalarFieldContainer[bool]
    advantages: _containers.RepeatedScalarFieldContainer[float]
    behaviour_logprobs: _containers.RepeatedScalarFieldContainer[float]
    reference_logprobs: _containers.RepeatedScalarFieldContainer[float]
    sampler_logprobs: _containers.RepeatedScalarFieldContainer[float]
    weights_versions: _containers.RepeatedScalarFieldContainer[int]
    weights_version_spans: _containers.RepeatedCompositeFieldContainer[WeightsVersionSpan]
    routed_experts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[str] = ..., request_id: _Optional[str] = ..., sequences: _Optional[_Union[Sequences, _Mapping]] = ..., loss_mask: _Optional[_Iterable[bool]] = ..., advantages: _Optional[_Iterable[float]] = ..., behaviour_logprobs: _Optional[_Iterable[float]] = ..., reference_logprobs: _Optional[_Iterable[float]] = ..., sampler_logprobs: _Optional[_Iterable[float]] = ..., weights_versions: _Optional[_Iterable[int]] = ..., weights_version_spans: _Optional[_Iterable[_Union[WeightsVersionSpan, _Mapping]]] = ..., routed_experts: _Optional[_Iterable[int]] = ...) -> None: ...

class WeightsVersionSpan(_message.Message):
    __slots__ = ("sequence", "start", "end", "version")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    start: int
    end: int
    version: int
    def __init__(self, sequence: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class StepCounts(_message.Message):
    __slots__ = ("microbatches", "sequences", "valid_tokens", "valid_sequences")
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    VALID_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VALID_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    microbatches: int
    sequences: int
    valid_tokens: int
    valid_sequences: int
    def __init__(self, microbatches: _Optional[int] = ..., sequences: _Optional[int] = ..., valid_tokens: _Optional[int] = ..., valid_sequences: _Optional[int] = ...) -> None: ...

class TrainMicrobatchResponse(_message.Message):
    __slots__ = ("step_id", "request_id", "duplicate", "accumulated")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    ACCUMULATED_FIELD_NUMBER: _ClassVar[int]
    step_id: str
    request_id: str
    duplicate: bool
    accumulated: StepCounts
    def __init__(self, step_id: _Optional[str] = ..., request_id: _Optional[str] = ..., duplicate: _Optional[bool] = ..., accumulated: _Optional[_Union[StepCounts, _Mapping]] = ...) -> None: ...

class FinishTrainStepRequest(_message.Message):
    __slots__ = ("step_id", "wait_for_update", "wait_for_publication")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_UPDATE_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_PUBLICATION_FIELD_NUMBER: _ClassVar[int]
    step_id: str
    wait_for_update: bool
    wait_for_publication: bool
    def __init__(self, step_id: _Optional[str] = ..., wait_for_update: _Optional[bool] = ..., wait_for_publication: _Optional[bool] = ...) -> None: ...

class LossTerms(_message.Message):
    __slots__ = ("policy", "kl", "clip_fraction", "importance_ratio", "entropy", "sampler", "load_balancing")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    KL_FIELD_NUMBER: _ClassVar[int]
    CLIP_FRACTION_FIELD_NUMBER: _ClassVar[int]
    IMPORTANCE_RATIO_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    LOAD_BALANCING_FIELD_NUMBER: _ClassVar[int]
    policy: float
    kl: float
    clip_fraction: float
    importance_ratio: float
    entropy: float
    sampler: SamplerMismatch
    load_balancing: float
    def __init__(self, policy: _Optional[float] = ..., kl: _Optional[float] = ..., clip_fraction: _Optional[float] = ..., importance_ratio: _Optional[float] = ..., entropy: _Optional[float] = ..., sampler: _Optional[_Union[SamplerMismatch, _Mapping]] = ..., load_balancing: _Optional[float] = ...) -> None: ...

class SamplerMismatch(_message.Message):
    __slots__ = ("ratio_mean", "ratio_min", "ratio_max", "corrected_fraction", "kl")
    RATIO_MEAN_FIELD_NUMBER: _ClassVar[int]
    RATIO_MIN_FIELD_NUMBER: _ClassVar[int]
    RATIO_MAX_FIELD_NUMBER: _ClassVar[int]
    CORRECTED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    KL_FIELD_NUMBER: _ClassVar[int]
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    corrected_fraction: float
    kl: float
    def __init__(self, ratio_mean: _Optional[float] = ..., ratio_min: _Optional[float] = ..., ratio_max: _Optional[float] = ..., corrected_fraction: _Optional[float] = ..., kl: _Optional[float] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("loss", "terms", "grad_norm", "learning_rate", "counts", "gradient", "staleness", "expert_load")
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TERMS_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_LOAD_FIELD_NUMBER: _ClassVar[int]
    loss: float
    terms: LossTerms
    grad_norm: float
    learning_rate: float
    counts: StepCounts
    gradient: StepGradient
    staleness: _containers.RepeatedCompositeFieldContainer[StalenessCount]
    expert_load: _containers.RepeatedCompositeFieldContainer[ExpertLoad]
    def __init__(self, loss: _Optional[float] = ..., terms: _Optional[_Union[LossTerms, _Mapping]] = ..., grad_norm: _Optional[float] = ..., learning_rate: _Optional[float] = ..., counts: _Optional[_Union[StepCounts, _Mapping]] = ..., gradient: _Optional[_Union[StepGradient, str]] = ..., staleness: _Optional[_Iterable[_Union[StalenessCount, _Mapping]]] = ..., expert_load: _Optional[_Iterable[_Union[ExpertLoad, _Mapping]]] = ...) -> None: ...

class StalenessCount(_message.Message):
    __slots__ = ("versions_behind", "sequences")
    VERSIONS_BEHIND_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    versions_behind: int
    sequences: int
    def __init__(self, versions_behind: _Optional[int] = ..., sequences: _Optional[int] = ...) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("layer", "max_tokens", "mean_tokens")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    max_tokens: float
    mean_tokens: float
    def __init__(self, layer: _Optional[int] = ..., max_tokens: _Optional[float] = ..., mean_tokens: _Optional[float] = ...) -> None: ...

class FinishTrainStepResponse(_message.Message):
    __slots__ = ("step_id", "metrics", "weights_version", "publication")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    PUBLICATION_FIELD_NUMBER: _ClassVar[int]
    step_id: str
    metrics: StepMetrics
    weights_version: int
    publication: Publication
    def __init__(self, step_id: _Optional[str] = ..., metrics: _Optional[_Union[StepMetrics, _Mapping]] = ..., weights_version: _Optional[int] = ..., publication: _Optional[_Union[Publication, _Mapping]] = ...) -> None: ...

class Publication(_message.Message):
    __slots__ = ("weights_version", "state", "reason")
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    weights_version: int
    state: PublicationState
    reason: str
    def __init__(self, weights_version: _Optional[int] = ..., state: _Optional[_Union[PublicationState, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortTrainStepRequest(_message.Message):
    __slots__ = ("step_id",)
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    step_id: str
    def __init__(self, step_id: _Optional[str] = ...) -> None: ...

class AbortTrainStepResponse(_message.Message):
    __slots__ = ("step_id", "aborted")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    step_id: str
    aborted: bool
    def __init__(self, step_id: _Optional[str] = ..., aborted: _Optional[bool] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("sequences", "outputs", "top_k", "routed_experts")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    sequences: Sequences
    outputs: _containers.RepeatedScalarFieldContainer[ForwardOutput]
    top_k: int
    routed_experts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sequences: _Optional[_Union[Sequences, _Mapping]] = ..., outputs: _Optional[_Iterable[_Union[ForwardOutput, str]]] = ..., top_k: _Optional[int] = ..., routed_experts: _Optional[_Iterable[int]] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("logprobs", "entropy", "top_k_token_ids", "top_k_logprobs", "top_k", "weights_version", "reference_logprobs", "routed_experts", "routed_top_k")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    TOP_K_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_TOP_K_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    entropy: _containers.RepeatedScalarFieldContainer[float]
    top_k_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_k_logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_k: int
    weights_version: int
    reference_logprobs: _containers.RepeatedScalarFieldContainer[float]
    routed_experts: _containers.RepeatedScalarFieldContainer[int]
    routed_top_k: int
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., entropy: _Optional[_Iterable[float]] = ..., top_k_token_ids: _Optional[_Iterable[int]] = ..., top_k_logprobs: _Optional[_Iterable[float]] = ..., top_k: _Optional[int] = ..., weights_version: _Optional[int] = ..., reference_logprobs: _Optional[_Iterable[float]] = ..., routed_experts: _Optional[_Iterable[int]] = ..., routed_top_k: _Optional[int] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("path", "weights_version", "optimizer_step")
    PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEP_FIELD_NUMBER: _ClassVar[int]
    path: str
    weights_version: int
    optimizer_step: int
    def __init__(self, path: _Optional[str] = ..., weights_version: _Optional[int] = ..., optimizer_step: _Optional[int] = ...) -> None: ...

class LoadCheckpointRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class LoadCheckpointResponse(_message.Message):
    __slots__ = ("weights_version", "optimizer_step")
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEP_FIELD_NUMBER: _ClassVar[int]
    weights_version: int
    optimizer_step: int
    def __init__(self, weights_version: _Optional[int] = ..., optimizer_step: _Optional[int] = ...) -> None: ...

class ExportHFRequest(_message.Message):
    __slots__ = ("path", "dtype", "max_file_bytes")
    PATH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_FILE_BYTES_FIELD_NUMBER: _ClassVar[int]
    path: str
    dtype: ExportDType
    max_file_bytes: int
    def __init__(self, path: _Optional[str] = ..., dtype: _Optional[_Union[ExportDType, str]] = ..., max_file_bytes: _Optional[int] = ...) -> None: ...

class ExportHFResponse(_message.Message):
    __slots__ = ("path", "weights_version", "num_tensors", "num_bytes")
    PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    path: str
    weights_version: int
    num_tensors: int
    num_bytes: int
    def __init__(self, path: _Optional[str] = ..., weights_version: _Optional[int] = ..., num_tensors: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("architecture", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "vocab_size", "padded_vocab_size", "num_parameters", "params_dtype", "tied_embeddings", "max_sequence_length")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUERY_GROUPS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    PADDED_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TIED_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    padded_vocab_size: int
    num_parameters: int
    params_dtype: _common_pb2.DType
    tied_embeddings: bool
    max_sequence_length: int
    def __init__(self, architecture: _Optional[str] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_attention_heads: _Optional[int] = ..., num_query_groups: _Optional[int] = ..., vocab_size: _Optional[int] = ..., padded_vocab_size: _Optional[int] = ..., num_parameters: _Optional[int] = ..., params_dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., tied_embeddings: _Optional[bool] = ..., max_sequence_length: _Optional[int] = ...) -> None: ...

class OpenStep(_message.Message):
    __slots__ = ("step_id", "loss", "accumulated")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    ACCUMULATED_FIELD_NUMBER: _ClassVar[int]
    step_id: str
    loss: LossConfig
    accumulated: StepCounts
    def __init__(self, step_id: _Optional[str] = ..., loss: _Optional[_Union[LossConfig, _Mapping]] = ..., accumulated: _Optional[_Union[StepCounts, _Mapping]] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("layout", "model", "weights_version", "optimizer_step", "open_step", "device", "sidecar", "refit_snapshot_bytes", "pass_token_budget", "publications", "sequence_layout", "reference_policy", "reference_placement")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEP_FIELD_NUMBER: _ClassVar[int]
    OPEN_STEP_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_FIELD_NUMBER: _ClassVar[int]
    REFIT_SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PASS_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    PUBLICATIONS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_POLICY_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.ParallelLayout
    model: ModelInfo
    weights_version: int
    optimizer_step: int
    open_step: OpenStep
    device: str
    sidecar: str
    refit_snapshot_bytes: int
    pass_token_budget: int
    publications: _containers.RepeatedCompositeFieldContainer[Publication]
    sequence_layout: str
    reference_policy: str
    reference_placement: str
    def __init__(self, layout: _Optional[_Union[_common_pb2.ParallelLayout, _Mapping]] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., weights_version: _Optional[int] = ..., optimizer_step: _Optional[int] = ..., open_step: _Optional[_Union[OpenStep, _Mapping]] = ..., device: _Optional[str] = ..., sidecar: _Optional[str] = ..., refit_snapshot_bytes: _Optional[int] = ..., pass_token_budget: _Optional[int] = ..., publications: _Optional[_Iterable[_Union[Publication, _Mapping]]] = ..., sequence_layout: _Optional[str] = ..., reference_policy: _Optional[str] = ..., reference_placement: _Optional[str] = ...) -> None: ...
