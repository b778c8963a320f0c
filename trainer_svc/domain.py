"""Domain types of the trainer service: what the wire means, independent of protobuf and torch."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from trainer_refit.errors import InvalidRequest


class InvalidArgument(InvalidRequest):
    """The request itself is wrong; nothing was changed. Maps to INVALID_ARGUMENT, with a
    BadRequest detail naming `field` (the dotted path in the request message) when given."""


class FailedPrecondition(RuntimeError):
    """The request is well-formed but the service state forbids it. Maps to FAILED_PRECONDITION."""


class AlreadyExists(FailedPrecondition):
    """The request names something that exists already with other contents (a microbatch's
    request_id reused for different data); nothing was changed. Maps to ALREADY_EXISTS (a
    refusal by the service's state, so a FailedPrecondition to code that catches those)."""


class PathNotAllowed(FailedPrecondition):
    """A checkpoint or export path outside the directories the service is configured to use
    (`runtime/path_roots.py`); nothing was changed. Maps to PERMISSION_DENIED (a refusal by
    the service's configuration, so a FailedPrecondition to code that catches those)."""


class Internal(RuntimeError):
    """A command failed for a reason that is not the request's fault (a bug, a rank's
    resources); every rank failed it together, so the service keeps serving. Maps to INTERNAL.
    Made by `runtime.agreement.fault` only: its message is an error id, whose traceback is in
    the server log, never the text of the exception behind it."""


class LossKind(enum.Enum):
    CROSS_ENTROPY = "cross_entropy"
    PPO = "ppo"
    """Clipped importance-weighted policy gradient per token (PPO; GRPO, DAPO's clip-higher)."""
    GSPO = "gspo"
    """The ratio of a sequence's geometric-mean token ratio, clipped per sequence (GSPO's
    token-level form: with one advantage per sequence it is GSPO itself)."""
    CISPO = "cispo"
    """REINFORCE on log pi weighted by the clipped importance ratio, the weight held constant
    (CISPO): clipped tokens still train."""


class ExportDType(enum.Enum):
    """The dtype of an exported checkpoint's weights."""

    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"
    PARAMS = "params"
    """The trainer's own parameter dtype: the weights bit for bit."""


class Normalization(enum.Enum):
    TOKEN = "token"
    SEQUENCE = "sequence"
    CONSTANT = "constant"
    """Token sums divided by a fixed length times the step's sequence count (Dr. GRPO)."""


class Correction(enum.Enum):
    """How the policy term corrects for the sampler (vLLM) differing from the trainer's
    policy the ratio is taken against (see trainer.proto)."""

    NONE = "none"
    TIS = "tis"
    """Truncated importance sampling: each term weighted by min(pi_old / mu, cap)."""
    ICEPOP = "icepop"
    """Terms whose pi_old / mu lies outside [low, high] are dropped (weight 0), the rest kept."""


class CorrectionLevel(enum.Enum):
    TOKEN = "token"
    """Each token's own ratio."""
    SEQUENCE = "sequence"
    """TIS: the sequence's product of ratios; IcePop: its geometric mean (a product of many
    tokens leaves any band)."""


class ReferenceSource(enum.Enum):
    """Where the KL term's reference logprobs come from."""

    CLIENT = "client"
    """Sent with each microbatch (reference_logprobs)."""
    SERVICE = "service"
    """Computed by the service from its frozen reference weights (--reference-policy)."""


class StaleData(enum.Enum):
    """What a step does with a sequence sampled more versions ago than its bound."""

    REFUSE = "refuse"
    """The whole microbatch is refused and changes nothing."""
    MASK = "mask"
    """The stale sequences train nothing (their loss mask cleared); the rest trains."""


@dataclass(frozen=True, kw_only=True)
class StalenessBound:
    """A step's bound on how many versions behind its weights a sequence may have been
    sampled (an asynchronous loop's off-policyness)."""

    max_versions: int
    stale: StaleData = StaleData.REFUSE

    def __post_init__(self) -> None:
        if self.max_versions < 0:
            raise InvalidArgument(
                f"max_staleness must be >= 0, got {self.max_versions}", field="max_staleness"
            )


class ForwardOutput(enum.Enum):
    LOGPROBS = "logprobs"
    TOP_K = "top_k"
    ENTROPY = "entropy"
    REFERENCE_LOGPROBS = "reference_logprobs"
    """Under the service's reference weights (--reference-policy)."""
    ROUTED_EXPERTS = "routed_experts"
    """A mixture-of-experts model's routing of each token, by layer."""


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    kind: LossKind = LossKind.CROSS_ENTROPY
    normalization: Normalization = Normalization.TOKEN
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    dual_clip: float = 0.0
    """PPO and GSPO: for negative advantages the loss is at most ``-dual_clip * advantage``
    (dual-clip PPO); 0 turns it off, otherwise > 1."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus subtracted from the loss; 0 turns it off."""
    normalization_length: int = 0
    """CONSTANT normalization's length (e.g. the longest generation allowed)."""
    reference_source: ReferenceSource = ReferenceSource.CLIENT
    correction: Correction = Correction.NONE
    correction_level: CorrectionLevel = CorrectionLevel.TOKEN
    tis_cap: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0

    def __post_init__(self) -> None:
        if not (0.0 <= self.clip_low < 1.0):
            raise InvalidArgument(
                f"clip_low must lie in [0, 1), got {self.clip_low}", field="loss.clip_low"
            )
        for name in ("clip_high", "kl_coef", "entropy_coef"):
            value = getattr(self, name)
            if not (value >= 0.0 and np.isfinite(value)):
                raise InvalidArgument(
                    f"{name} must be a finite value >= 0, got {value}", field=f"loss.{name}"
                )
        if self.dual_clip != 0.0 and not (self.dual_clip > 1.0 and np.isfinite(self.dual_clip)):
            raise InvalidArgument(
                f"dual_clip must be 0 (off) or a finite value > 1, got {self.dual_clip}",
                field="loss.dual_clip",
            )
        if self.dual_clip and self.kind not in (LossKind.PPO, LossKind.GSPO):
            raise InvalidArgument(
                f"dual_clip applies to the ppo and gspo losses, not {self.kind.value}",
                field="loss.dual_clip",
            )
        constant = self.normalization is Normalization.CONSTANT
        if constant != (self.normalization_length > 0) or self.normalization_length < 0:
            raise InvalidArgument(
                "normalization_length must be > 0 with the constant normalization and absent "
                f"otherwise, got {self.normalization_length} with {self.normalization.value}",
                field="loss.normalization_length",
            )
        if self.reference_source is ReferenceSource.SERVICE and not self.kl_coef:
            raise InvalidArgument(
                "reference logprobs from the service serve the KL term: set kl_coef > 0",
                field="loss.reference_source",
            )
        if self.correction is not Correction.NONE and self.kind is LossKind.CROSS_ENTROPY:
            raise InvalidArgument(
                "a sampler correction weights a policy-gradient loss, not cross_entropy",
                field="loss.correction",
            )
        if not (self.tis_cap >= 1.0 and np.isfinite(self.tis_cap)):
            raise InvalidArgument(
                f"tis_cap must be a finite value >= 1, got {self.tis_cap}", field="loss.tis_cap"
            )
        if not (0.0 <= self.icepop_low < 1.0 < self.icepop_high and np.isfinite(self.icepop_high)):
            raise InvalidArgument(
                f"the IcePop band must satisfy 0 <= icepop_low < 1 < icepop_high (finite), got "
                f"[{self.icepop_low}, {self.icepop_high}]",
                field="loss.icepop_low",
            )
        if self.kind is LossKind.GSPO and self.normalization is not Normalization.SEQUENCE:
            # GSPO's ratio and clipping are per sequence, so is its objective: weighting its
            # sequences by their token counts would scale long sequences' clipped terms.
            raise InvalidArgument(
                f"the gspo loss is a per-sequence objective: it needs the sequence "
                f"normalization, not {self.normalization.value}",
                field="loss.normalization",
            )

    @property
    def needs_policy_inputs(self) -> bool:
        return self.kind in (LossKind.PPO, LossKind.GSPO, LossKind.CISPO)

    @property
    def needs_reference_logprobs(self) -> bool:
        """Whether microbatches carry reference logprobs (the client computes them)."""
        return self.needs_reference and self.reference_source is ReferenceSource.CLIENT

    @property
    def corrects_sampler(self) -> bool:
        return self.correction is not Correction.NONE

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0.0


@dataclass(frozen=True, kw_only=True)
class OptimizerOverrides:
    """Per-step hyper-parameters; None keeps the service's current value."""

    learning_rate: float | None = None
    weight_decay: float | None = None
    adam_beta1: float | None = None
    adam_beta2: float | None = None
    adam_eps: float | None = None
    max_grad_norm: float | None = None

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value is not None and not (np.isfinite(value) and value >= 0):
                raise InvalidArgument(
                    f"optimizer.{name} must be a finite value >= 0, got {value}",
                    field=f"optimizer.{name}",
                )
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            if value is not None and value >= 1.0:
                raise InvalidArgument(
                    f"optimizer.{name} must be < 1, got {value}", field=f"optimizer.{name}"
                )
        if self.adam_eps is not None and self.adam_eps <= 0:
            raise InvalidArgument("optimizer.adam_eps must be > 0", field="optimizer.adam_eps")


NO_VERSION = -1
"""In `SequenceBatch.sampled_versions`: a token no version names."""


@dataclass(frozen=True)
class VersionSpan:
    """Token positions [start, end) of one sequence were sampled with weights `version`
    (auto-refit's attribution of a completion that crossed a refit, shifted by its prompt)."""

    start: int
    end: int
    version: int


_BATCH_ARRAYS = (
    "tokens",
    "offsets",
    "loss_mask",
    "advantages",
    "behaviour_logprobs",
    "reference_logprobs",
    "sampler_logprobs",
    "weights_versions",
    "spans",
    "routed_experts",
)


@dataclass(frozen=True, kw_only=True, eq=False)
class SequenceBatch:
    """A ragged batch; per-token arrays are aligned with ``tokens`` (see trainer.proto)."""

    tokens: np.ndarray
    offsets: np.ndarray
    loss_mask: np.ndarray | None = None
    advantages: np.ndarray | None = None
    behaviour_logprobs: np.ndarray | None = None
    reference_logprobs: np.ndarray | None = None
    sampler_logprobs: np.ndarray | None = None
    """The sampler's (vLLM's) logprobs, for a correction against it (LossConfig.correction)."""
    weights_versions: np.ndarray | None = None
    """Per sequence (not per token): the weights version it was sampled with, for a
    staleness bound (StalenessBound)."""
    spans: np.ndarray | None = None
    """Weights version spans, ``[n, 4]`` int64 rows of (sequence, start, end, version): the
    tokens [start, end) of that sequence were sampled with that version (`VersionSpan`).
    Checked by `validation.check_training_batch` before `sampled_versions` expands them."""
    routed_experts: np.ndarray | None = None
    """``[num_tokens, num_layers * top_k]`` int64: the experts each token went to as an input,
    by layer (a mixture-of-experts model's routing to replay; the last token of each sequence
    is no input and its row is ignored)."""

    @classmethod
    def from_lists(
        cls,
        sequences: Sequence[Sequence[int]],
        *,
        loss_mask: Sequence[Sequence[bool]] | None = None,
        advantages: Sequence[Sequence[float]] | None = None,
        behaviour_logprobs: Sequence[Sequence[float]] | None = None,
        reference_logprobs: Sequence[Sequence[float]] | None = None,
        sampler_logprobs: Sequence[Sequence[float]] | None = None,
        weights_versions: Sequence[int] | None = None,
        version_spans: Sequence[Sequence[VersionSpan]] | None = None,
        routed_experts: Sequence[np.ndarray] | None = None,
    ) -> SequenceBatch:
        """Builds a batch from per-sequence lists (each per-token list as long as its sequence;
        `version_spans`: one list of spans per sequence; `routed_experts`: per sequence its
        tokens' experts, ``[tokens, layers, top_k]`` as vLLM reports them, or flattened)."""
        lengths = [len(s) for s in sequences]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

        def flat(rows: Sequence[Sequence[float]] | None, dtype: type) -> np.ndarray | None:
            if rows is None:
                return None
            if not rows:
                return np.zeros(0, dtype=dtype)
            return np.concatenate([np.asarray(r, dtype=dtype) for r in rows])

        return cls(
            tokens=np.concatenate(
                [np.zeros(0, np.int64), *(np.asarray(s, np.int64) for s in sequences)]
            ),
            offsets=offsets,
            loss_mask=flat(loss_mask, bool),
            advantages=flat(advantages, np.float32),
            behaviour_logprobs=flat(behaviour_logprobs, np.float32),
            reference_logprobs=flat(reference_logprobs, np.float32),
            sampler_logprobs=flat(sampler_logprobs, np.float32),
            weights_versions=None
            if weights_versions is None
            else np.asarray(weights_versions, dtype=np.int64),
            spans=None
            if version_spans is None
            else span_rows((i, span) for i, spans in enumerate(version_spans) for span in spans),
            routed_experts=None
            if routed_experts is None
            else np.concatenate(
                [np.asarray(r, np.int64).reshape(len(r), -1) for r in routed_experts]
            ),
        )

    def version_spans(self) -> list[tuple[int, VersionSpan]]:
        """The spans as (sequence, span) pairs, in the batch's order."""
        if self.spans is None:
            return []
        return [(int(i), VersionSpan(int(a), int(b), int(v))) for i, a, b, v in self.spans]

    def sampled_versions(self) -> np.ndarray | None:
        """Per token, the weights version that sampled it as far as the batch says (its span's,
        else its sequence's; the older where both do), NO_VERSION where neither does; None
        when the batch names no versions. Spans must have been checked."""
        if self.weights_versions is None and self.spans is None:
            return None
        per_token = np.full(self.num_tokens, NO_VERSION, dtype=np.int64)
        if self.weights_versions is not None:
            per_token = np.repeat(self.weights_versions, self.lengths())
        for sequence, start, end, version in self.spans if self.spans is not None else ():
            base = self.offsets[sequence]
            tokens = per_token[base + start : base + end]
            tokens[(tokens == NO_VERSION) | (tokens > version)] = version
        return per_token

    def digest(self) -> bytes:
        """A 16-byte BLAKE2b digest of every array, its dtype and shape, and which optional
        arrays are present: equal batches have equal digests, and a changed element, a
        different length or a missing array changes it."""
        digest = hashlib.blake2b(digest_size=16)
        for name in _BATCH_ARRAYS:
            values = getattr(self, name)
            if values is None:
                digest.update(f"{name}:absent;".encode())
                continue
            array = np.ascontiguousarray(values)
            digest.update(f"{name}:{array.dtype.str}:{array.shape};".encode())
            digest.update(array.tobytes())
        return digest.digest()

    def per_sequence(self, values: np.ndarray) -> list[np.ndarray]:
        """Splits a per-token array back into one array per sequence."""
        return [values[a:b] for a, b in zip(self.offsets[:-1], self.offsets[1:], strict=True)]

    @property
    def num_sequences(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def valid_tokens_per_sequence(self) -> np.ndarray:
        if self.loss_mask is None:
            return np.zeros(self.num_sequences, dtype=np.int64)
        csum = np.concatenate([[0], np.cumsum(self.loss_mask, dtype=np.int64)])
        return csum[self.offsets[1:]] - csum[self.offsets[:-1]]

    def select(self, indices: np.ndarray) -> SequenceBatch:
        """The sub-batch of the given sequences, in that order."""
        pieces = [np.arange(self.offsets[i], self.offsets[i + 1]) for i in indices]
        flat = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum([len(p) for p in pieces], dtype=np.int64)])

        def take(array: np.ndarray | None) -> np.ndarray | None:
            return None if array is None else array[flat]

        return SequenceBatch(
            tokens=self.tokens[flat],
            offsets=offsets.astype(np.int64),
            loss_mask=take(self.loss_mask),
            advantages=take(self.advantages),
            behaviour_logprobs=take(self.behaviour_logprobs),
            reference_logprobs=take(self.reference_logprobs),
            sampler_logprobs=take(self.sampler_logprobs),
            weights_versions=None
            if self.weights_versions is None
            else self.weights_versions[np.asarray(indices, dtype=np.int64)],
            spans=None if self.spans is None else self._spans_of(indices),
            routed_experts=take(self.routed_experts),
        )

    def _spans_of(self, indices: np.ndarray) -> np.ndarray:
        """The spans of the sequences `indices`, renumbered to their places in that list."""
        assert self.spans is not None
        places: dict[int, list[int]] = {}
        for place, index in enumerate(np.asarray(indices).tolist()):
            places.setdefault(index, []).append(place)
        rows = sorted(
            (place, start, end, version)
            for sequence, start, end, version in self.spans.tolist()
            for place in places.get(sequence, ())
        )
        return np.asarray(rows, dtype=np.int64).reshape(-1, 4)

    def without_sequences(self, dropped: np.ndarray) -> SequenceBatch:
        """The batch with the loss mask cleared on the sequences where `dropped` (per
        sequence) is true: they go through the model but train nothing."""
        if self.loss_mask is None or not dropped.any():
            return self
        return self.without_tokens(np.repeat(dropped, self.lengths()))

    def without_tokens(self, dropped: np.ndarray) -> SequenceBatch:
        """The batch with the loss mask cleared where `dropped` (per token) is true."""
        if self.loss_mask is None or not dropped.any():
            return self
        return dataclasses.replace(self, loss_mask=self.loss_mask & ~dropped)


def span_rows(spans: Iterable[tuple[int, VersionSpan]]) -> np.ndarray:
    """`SequenceBatch.spans` from (sequence, span) pairs."""
    rows = [(index, span.start, span.end, span.version) for index, span in spans]
    return np.asarray(rows, dtype=np.int64).reshape(-1, 4)


@dataclass(frozen=True, kw_only=True)
class StepCounts:
    microbatches: int = 0
    sequences: int = 0
    valid_tokens: int = 0
    valid_sequences: int = 0
    """Sequences with at least one valid token: the divisor of sequence-level normalization."""

    def plus(self, batch: SequenceBatch) -> StepCounts:
        per_sequence = batch.valid_tokens_per_sequence()
        return StepCounts(
            microbatches=self.microbatches + 1,
            sequences=self.sequences + batch.num_sequences,
            valid_tokens=self.valid_tokens + int(per_sequence.sum()),
            valid_sequences=self.valid_sequences + int((per_sequence > 0).sum()),
        )


@dataclass(frozen=True, kw_only=True)
class LossTerms:
    policy: float = 0.0
    kl: float = 0.0
    clip_fraction: float = 0.0
    importance_ratio: float = 0.0
    entropy: float = 0.0
    """Mean entropy per valid token; computed with an entropy bonus or a sampler correction
    (0 otherwise)."""
    sampler: SamplerMismatch | None = None
    """How far the sampler was from the policy the ratio is taken against (a correction)."""
    load_balancing: float = 0.0
    """A mixture-of-experts model's Switch loss per routed token and layer (1: even)."""


@dataclass(frozen=True, kw_only=True)
class ExpertLoad:
    """Tokens one layer routed over a step: to its busiest expert and to one on average."""

    layer: int
    max_tokens: float
    mean_tokens: float


@dataclass(frozen=True, kw_only=True)
class SamplerMismatch:
    """Per step, over the trained tokens, of pi_old / mu (pi_old the policy the ratio is taken
    against, mu the sampler's)."""

    ratio_mean: float = 0.0
    ratio_min: float = 0.0
    ratio_max: float = 0.0
    corrected_fraction: float = 0.0
    """Tokens truncated (TIS) or dropped (IcePop), over the trained tokens."""
    kl: float = 0.0
    """k3 estimate of KL(mu || pi_old) per trained token."""


class StepGradient(enum.Enum):
    """Whether a finished step's data could move the weights (see trainer.proto)."""

    NONZERO = "nonzero"
    ZERO = "zero"
    """Every element of the step's gradient was exactly zero: the optimizer stepped (its step
    count, and weight decay and momentum from earlier steps, may still change the weights),
    but this step's data taught the model nothing: e.g. PPO without a KL term where every
    token's ratio is clipped or past the log-ratio clamp (`losses.LOG_RATIO_LIMIT`)."""
    UNREPORTED = "unreported"
    """The answer did not say (a server older than the field): a client cannot tell."""


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    loss: float
    terms: LossTerms
    grad_norm: float
    learning_rate: float
    counts: StepCounts
    gradient: StepGradient
    staleness: tuple[tuple[int, int], ...] = ()
    """(versions behind the step's weights, sequences) for the sequences that named the
    version they were sampled with, by versions behind."""
    expert_load: tuple[ExpertLoad, ...] = ()
    """Per layer of a mixture-of-experts model (empty for a dense one)."""


@dataclass(frozen=True, kw_only=True)
class ForwardResult:
    logprobs: np.ndarray | None = None
    entropy: np.ndarray | None = None
    top_k_token_ids: np.ndarray | None = None
    top_k_logprobs: np.ndarray | None = None
    top_k: int = 0
    weights_version: int = 0
    reference_logprobs: np.ndarray | None = None
    routed_experts: np.ndarray | None = None
    """``[num_tokens, num_layers, top_k]`` (ForwardOutput.ROUTED_EXPERTS)."""


class PublicationState(enum.Enum):
    """Where a weights version stands on its way to the refit sidecar."""

    PENDING = "pending"
    """The ranks are reporting it."""
    RETRYING = "retrying"
    """A report failed and is being sent again."""
    READABLE = "readable"
    """Every rank reported it: receivers can read it."""
    FAILED = "failed"
    """It will never be readable; receivers follow the next version."""
    NOT_PUBLISHED = "not_published"
    """Made by a step that does not publish (`RefitConfig.publish_every`)."""

    @property
    def settled(self) -> bool:
        return self not in (PublicationState.PENDING, PublicationState.RETRYING)


@dataclass(frozen=True, kw_only=True)
class Publication:
    weights_version: int
    state: PublicationState
    reason: str = ""
    """Why it is RETRYING or FAILED."""


@dataclass(frozen=True, kw_only=True)
class OpenStepInfo:
    step_id: str
    loss: LossConfig
    counts: StepCounts = field(default_factory=StepCounts)
