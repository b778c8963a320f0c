"""Protobuf <-> domain conversion. Only this module and the servicer know the wire types."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from trainer_refit.v1 import trainer_pb2 as pb
from trainer_svc.domain import (
    ExportDType,
    ForwardOutput,
    ForwardResult,
    InvalidArgument,
    LossConfig,
    OpenStepInfo,
    OptimizerOverrides,
    Publication,
    SamplerMismatch,
    SequenceBatch,
    StalenessBound,
    StepCounts,
    StepMetrics,
    VersionSpan,
    span_rows,
)
from trainer_svc.wire_enums import (
    CORRECTION_LEVELS,
    CORRECTION_LEVELS_TO_PROTO,
    CORRECTIONS,
    CORRECTIONS_TO_PROTO,
    EXPORT_DTYPES,
    FORWARD_OUTPUTS,
    LOSS_KINDS,
    LOSS_KINDS_TO_PROTO,
    NORMALIZATIONS,
    NORMALIZATIONS_TO_PROTO,
    PUBLICATION_STATES_TO_PROTO,
    REFERENCE_SOURCES,
    REFERENCE_SOURCES_TO_PROTO,
    STALE_DATA,
    STALE_DATA_TO_PROTO,
    STEP_GRADIENTS_TO_PROTO,
)


def export_dtype(value: int) -> ExportDType:
    """An ExportHF request's dtype; UNSPECIFIED is bfloat16, as exported checkpoints ship."""
    if value == pb.EXPORT_DTYPE_UNSPECIFIED:
        return ExportDType.BFLOAT16
    dtype: ExportDType = _enum(value, EXPORT_DTYPES, "dtype", pb.ExportDType)
    return dtype


def _enum(value: int, table: dict, field: str, wrapper: Any) -> Any:
    if value not in table:
        names = ", ".join(wrapper.Name(k) for k in table)
        raise InvalidArgument(f"{field} must be one of {names}; got {value}", field=field)
    return table[value]


def loss_config(message: pb.LossConfig) -> LossConfig:
    kind = _enum(message.kind, LOSS_KINDS, "loss.kind", pb.LossKind)
    normalization = _enum(
        message.normalization, NORMALIZATIONS, "loss.normalization", pb.Normalization
    )
    return LossConfig(
        kind=kind,
        normalization=normalization,
        clip_low=message.clip_low if message.HasField("clip_low") else 0.2,
        clip_high=message.clip_high if message.HasField("clip_high") else 0.2,
        kl_coef=message.kl_coef if message.HasField("kl_coef") else 0.0,
        dual_clip=message.dual_clip if message.HasField("dual_clip") else 0.0,
        entropy_coef=message.entropy_coef if message.HasField("entropy_coef") else 0.0,
        normalization_length=message.normalization_length,
        correction=_enum(message.correction, CORRECTIONS, "loss.correction", pb.Correction),
        correction_level=_enum(
            message.correction_level,
            CORRECTION_LEVELS,
            "loss.correction_level",
            pb.CorrectionLevel,
        ),
        tis_cap=message.tis_cap if message.HasField("tis_cap") else 2.0,
        icepop_low=message.icepop_low if message.HasField("icepop_low") else 0.5,
        icepop_high=message.icepop_high if message.HasField("icepop_high") else 5.0,
        reference_source=_enum(
            message.reference_source,
            REFERENCE_SOURCES,
            "loss.reference_source",
            pb.ReferenceSource,
        ),
    )


def loss_config_to_proto(config: LossConfig) -> pb.LossConfig:
    return pb.LossConfig(
        kind=LOSS_KINDS_TO_PROTO[config.kind],
        normalization=NORMALIZATIONS_TO_PROTO[config.normalization],
        clip_low=config.clip_low,
        clip_high=config.clip_high,
        kl_coef=config.kl_coef,
        dual_clip=config.dual_clip,
        entropy_coef=config.entropy_coef,
        normalization_length=config.normalization_length or None,
        correction=CORRECTIONS_TO_PROTO[config.correction],
        correction_level=CORRECTION_LEVELS_TO_PROTO[config.correction_level],
        tis_cap=config.tis_cap,
        icepop_low=config.icepop_low,
        icepop_high=config.icepop_high,
        reference_source=REFERENCE_SOURCES_TO_PROTO[config.reference_source],
    )


def optimizer_overrides(message: pb.OptimizerParams) -> OptimizerOverrides:
    fields = (
        "learning_rate",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "adam_eps",
        "max_grad_norm",
    )
    return OptimizerOverrides(**{f: getattr(message, f) for f in fields if message.HasField(f)})


def _optional(values: object, dtype: type) -> np.ndarray | None:
    array: np.ndarray = np.asarray(values, dtype=dtype)
    return array if len(array) else None


def sequences(message: pb.Sequences) -> SequenceBatch:
    return SequenceBatch(
        tokens=np.asarray(message.tokens, dtype=np.int64),
        offsets=np.asarray(message.offsets, dtype=np.int64),
    )


def training_batch(message: pb.TrainMicrobatchRequest) -> SequenceBatch:
    base = sequences(message.sequences)
    return SequenceBatch(
        tokens=base.tokens,
        offsets=base.offsets,
        loss_mask=_optional(message.loss_mask, bool),
        advantages=_optional(message.advantages, np.float32),
        behaviour_logprobs=_optional(message.behaviour_logprobs, np.float32),
        reference_logprobs=_optional(message.reference_logprobs, np.float32),
        sampler_logprobs=_optional(message.sampler_logprobs, np.float32),
        weights_versions=_versions(message.weights_versions),
        spans=_spans(message),
        routed_experts=routed_experts(message.routed_experts, len(base.tokens)),
    )


def routed_experts(values: Any, num_tokens: int) -> np.ndarray | None:
    """The flat wire routing as ``[num_tokens, layers * top_k]`` (checked against the model
    later, by `validation.check_routed_experts`)."""
    if not len(values):
        return None
    flat = np.asarray(values, dtype=np.int64)
    if not num_tokens or len(flat) % num_tokens:
        raise InvalidArgument(
            f"routed_experts holds {len(flat)} entries, not a multiple of the {num_tokens} "
            "tokens: send num_tokens x num_layers x top_k",
            field="routed_experts",
        )
    return flat.reshape(num_tokens, -1)


def _spans(message: pb.TrainMicrobatchRequest) -> np.ndarray | None:
    """The weights version spans as rows (checked against the sequences later, by
    `validation.check_training_batch`); a version past int64's range is none a trainer made."""
    if not message.weights_version_spans:
        return None
    for span in message.weights_version_spans:
        if span.version >= 2**63:
            raise InvalidArgument(
                f"a weights version span names version {span.version}, no version a trainer "
                "has made",
                field="weights_version_spans",
            )
    return span_rows(
        (span.sequence, VersionSpan(span.start, span.end, span.version))
        for span in message.weights_version_spans
    )


def _versions(values: object) -> np.ndarray | None:
    """Per-sequence weights versions as int64; a uint64 past int64's range is no version the
    trainer can have made."""
    raw = np.asarray(values, dtype=np.uint64)
    if not len(raw):
        return None
    if int(raw.max()) >= 2**63:
        raise InvalidArgument(
            f"weights_versions holds {int(raw.max())}, no version a trainer has made",
            field="weights_versions",
        )
    return raw.astype(np.int64)


def staleness_bound(message: pb.BeginTrainStepRequest) -> StalenessBound | None:
    if not message.HasField("max_staleness"):
        return None
    stale = _enum(message.stale_data, STALE_DATA, "stale_data", pb.StaleData)
    return StalenessBound(max_versions=message.max_staleness, stale=stale)


def staleness_to_proto(bound: StalenessBound | None) -> dict[str, Any]:
    """BeginTrainStepRequest's fields for `bound` (none without one)."""
    if bound is None:
        return {}
    return {"max_staleness": bound.max_versions, "stale_data": STALE_DATA_TO_PROTO[bound.stale]}


def forward_outputs(message: pb.ForwardRequest) -> frozenset[ForwardOutput]:
    outputs = {_enum(o, FORWARD_OUTPUTS, "outputs", pb.ForwardOutput) for o in message.outputs}
    if not outputs:
        raise InvalidArgument(
            "outputs is empty: ask for at least one of LOGPROBS, TOP_K, ENTROPY, "
            "REFERENCE_LOGPROBS",
            field="outputs",
        )
    return frozenset(outputs)


def counts_to_proto(counts: StepCounts) -> pb.StepCounts:
    return pb.StepCounts(
        microbatches=counts.microbatches,
        sequences=counts.sequences,
        valid_tokens=counts.valid_tokens,
        valid_sequences=counts.valid_sequences,
    )


def _mismatch_to_proto(mismatch: SamplerMismatch | None) -> pb.SamplerMismatch | None:
    if mismatch is None:
        return None
    return pb.SamplerMismatch(**vars(mismatch))


def metrics_to_proto(metrics: StepMetrics) -> pb.StepMetrics:
    terms = metrics.terms
    return pb.StepMetrics(
        loss=metrics.loss,
        terms=pb.LossTerms(
            policy=terms.policy,
            kl=terms.kl,
            clip_fraction=terms.clip_fraction,
            importance_ratio=terms.importance_ratio,
            entropy=terms.entropy,
            sampler=_mismatch_to_proto(terms.sampler),
            load_balancing=terms.load_balancing,
        ),
        grad_norm=metrics.grad_norm,
        staleness=[
            pb.StalenessCount(versions_behind=behind, sequences=count)
            for behind, count in metrics.staleness
        ],
        expert_load=[
            pb.ExpertLoad(layer=e.layer, max_tokens=e.max_tokens, mean_tokens=e.mean_tokens)
            for e in metrics.expert_load
        ],
        learning_rate=metrics.learning_rate,
        counts=counts_to_proto(metrics.counts),
        gradient=STEP_GRADIENTS_TO_PROTO[metrics.gradient],
    )


def forward_to_proto(result: ForwardResult) -> pb.ForwardResponse:
    def flat(values: np.ndarray | None) -> list:
        return [] if values is None else values.reshape(-1).tolist()

    return pb.ForwardResponse(
        logprobs=flat(result.logprobs),
        entropy=flat(result.entropy),
        top_k_token_ids=flat(result.top_k_token_ids),
        top_k_logprobs=flat(result.top_k_logprobs),
        top_k=result.top_k,
        weights_version=result.weights_version,
        reference_logprobs=flat(result.reference_logprobs),
        routed_experts=flat(result.routed_experts),
        routed_top_k=0 if result.routed_experts is None else result.routed_experts.shape[-1],
    )


def open_step_to_proto(info: OpenStepInfo) -> pb.OpenStep:
    return pb.OpenStep(
        step_id=info.step_id,
        loss=loss_config_to_proto(info.loss),
        accumulated=counts_to_proto(info.counts),
    )


def path(value: str, field: str) -> Path:
    if not value:
        raise InvalidArgument(f"{field} must name a directory", field=field)
    return Path(value)


def publication_to_proto(publication: Publication) -> pb.Publication:
    return pb.Publication(
        weights_version=publication.weights_version,
        state=PUBLICATION_STATES_TO_PROTO[publication.state],
        reason=publication.reason,
    )
