"""The one table between the domain enums and their protobuf values, used by server and client."""

from __future__ import annotations

from trainer_refit.v1 import trainer_pb2 as pb
from trainer_svc.domain import (
    Correction,
    CorrectionLevel,
    ExportDType,
    ForwardOutput,
    LossKind,
    Normalization,
    PublicationState,
    ReferenceSource,
    StaleData,
    StepGradient,
)

LOSS_KINDS = {
    pb.LOSS_KIND_CROSS_ENTROPY: LossKind.CROSS_ENTROPY,
    pb.LOSS_KIND_PPO: LossKind.PPO,
    pb.LOSS_KIND_GSPO: LossKind.GSPO,
    pb.LOSS_KIND_CISPO: LossKind.CISPO,
}
NORMALIZATIONS = {
    pb.NORMALIZATION_TOKEN: Normalization.TOKEN,
    pb.NORMALIZATION_SEQUENCE: Normalization.SEQUENCE,
    pb.NORMALIZATION_CONSTANT: Normalization.CONSTANT,
}
CORRECTIONS = {
    pb.CORRECTION_UNSPECIFIED: Correction.NONE,
    pb.CORRECTION_TIS: Correction.TIS,
    pb.CORRECTION_ICEPOP: Correction.ICEPOP,
}
CORRECTION_LEVELS = {
    pb.CORRECTION_LEVEL_UNSPECIFIED: CorrectionLevel.TOKEN,
    pb.CORRECTION_LEVEL_SEQUENCE: CorrectionLevel.SEQUENCE,
}
REFERENCE_SOURCES = {
    pb.REFERENCE_SOURCE_UNSPECIFIED: ReferenceSource.CLIENT,
    pb.REFERENCE_SOURCE_SERVICE: ReferenceSource.SERVICE,
}
STALE_DATA = {
    pb.STALE_DATA_UNSPECIFIED: StaleData.REFUSE,
    pb.STALE_DATA_MASK: StaleData.MASK,
}
FORWARD_OUTPUTS = {
    pb.FORWARD_OUTPUT_LOGPROBS: ForwardOutput.LOGPROBS,
    pb.FORWARD_OUTPUT_TOP_K: ForwardOutput.TOP_K,
    pb.FORWARD_OUTPUT_ENTROPY: ForwardOutput.ENTROPY,
    pb.FORWARD_OUTPUT_REFERENCE_LOGPROBS: ForwardOutput.REFERENCE_LOGPROBS,
    pb.FORWARD_OUTPUT_ROUTED_EXPERTS: ForwardOutput.ROUTED_EXPERTS,
}
PUBLICATION_STATES = {
    pb.PUBLICATION_STATE_PENDING: PublicationState.PENDING,
    pb.PUBLICATION_STATE_RETRYING: PublicationState.RETRYING,
    pb.PUBLICATION_STATE_READABLE: PublicationState.READABLE,
    pb.PUBLICATION_STATE_FAILED: PublicationState.FAILED,
    pb.PUBLICATION_STATE_NOT_PUBLISHED: PublicationState.NOT_PUBLISHED,
}
EXPORT_DTYPES = {
    pb.EXPORT_DTYPE_BFLOAT16: ExportDType.BFLOAT16,
    pb.EXPORT_DTYPE_FLOAT32: ExportDType.FLOAT32,
    pb.EXPORT_DTYPE_PARAMS: ExportDType.PARAMS,
}
STEP_GRADIENTS = {
    pb.STEP_GRADIENT_NONZERO: StepGradient.NONZERO,
    pb.STEP_GRADIENT_ZERO: StepGradient.ZERO,
    pb.STEP_GRADIENT_UNSPECIFIED: StepGradient.UNREPORTED,  # only from an older server
}
LOSS_KINDS_TO_PROTO = {v: k for k, v in LOSS_KINDS.items()}
NORMALIZATIONS_TO_PROTO = {v: k for k, v in NORMALIZATIONS.items()}
CORRECTIONS_TO_PROTO = {v: k for k, v in CORRECTIONS.items()}
STALE_DATA_TO_PROTO = {v: k for k, v in STALE_DATA.items()}
REFERENCE_SOURCES_TO_PROTO = {v: k for k, v in REFERENCE_SOURCES.items()}
CORRECTION_LEVELS_TO_PROTO = {v: k for k, v in CORRECTION_LEVELS.items()}
FORWARD_OUTPUTS_TO_PROTO = {v: k for k, v in FORWARD_OUTPUTS.items()}
PUBLICATION_STATES_TO_PROTO = {v: k for k, v in PUBLICATION_STATES.items()}
STEP_GRADIENTS_TO_PROTO = {v: k for k, v in STEP_GRADIENTS.items()}
EXPORT_DTYPES_TO_PROTO = {v: k for k, v in EXPORT_DTYPES.items()}
