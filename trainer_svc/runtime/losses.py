"""Loss sums of one laid-out microbatch (`runtime/packing.py`: padded rows or one packed row).
Sums, never means: the step divides by the global count once, at finish, so any split of the
batch gives the same gradient."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer_svc.domain import Correction, CorrectionLevel, LossConfig, LossKind, Normalization

SUM_FIELDS = (
    "loss",
    "policy",
    "kl",
    "clipped_tokens",
    "ratio",
    "valid_tokens",
    "entropy",
    "sampler_ratio",
    "corrected_tokens",
    "mismatch_kl",
)
MAX_FIELDS = ("sampler_ratio_max", "sampler_ratio_neg_min")
"""Reduced by maximum, not by sum: the sampler ratio's largest and (negated) smallest value."""

LOG_RATIO_LIMIT = 20.0
"""Log-ratios are clamped to at most 20 before exp: the PPO ratio's to [-20, 20], the KL
estimate's (reference - policy) to <= 20.

Valid inputs can be far apart (a behaviour logprob of -100 against a policy logprob of -5 is a
log-ratio of 95, and exp(95) is inf in float32), and one inf turns the loss and every gradient
into inf/NaN. e^20 ~ 4.9e8 is far outside any clip range, so the loss stays finite for any
realistic advantage, and within the limit it is exactly the unclamped loss. A clamped token
gets no gradient through its ratio (like a clipped one). Below, exp cannot overflow: the KL
estimate keeps its exact value there; a PPO ratio under e^-20 contributes ~0 either way."""


def _clamped(log_ratio: torch.Tensor, *, symmetric: bool) -> torch.Tensor:
    low = -LOG_RATIO_LIMIT if symmetric else None
    return log_ratio.clamp(low, LOG_RATIO_LIMIT)


@dataclass
class TokenInputs:
    """Per-position tensors ``[rows, positions]`` aligned with the targets."""

    mask: torch.Tensor
    advantages: torch.Tensor | None = None
    behaviour_logprobs: torch.Tensor | None = None
    reference_logprobs: torch.Tensor | None = None
    sequence_tokens: torch.Tensor | None = None
    """Each position's sequence's count of trained tokens, for per-sequence means in either
    layout (a packed row holds many sequences); None: each row is one sequence."""
    sampler_logprobs: torch.Tensor | None = None
    sequence_index: torch.Tensor | None = None
    """Each position's sequence, numbered from 0 (int64), with `sequences` the count; None:
    each row is one sequence."""
    sequences: int = 0


def _sequence_sum(values: torch.Tensor, inputs: TokenInputs) -> torch.Tensor:
    """Each position's value replaced by the sum over its sequence's trained positions (no
    gradient). Segment sums with one index_add: no host synchronization."""
    mask = inputs.mask.to(values.dtype)
    index, count = inputs.sequence_index, inputs.sequences
    if index is None:
        rows = values.shape[0]
        index = torch.arange(rows, device=values.device)[:, None].expand_as(values)
        count = rows
    sums = torch.zeros(count, dtype=values.dtype, device=values.device)
    sums.index_add_(0, index.reshape(-1), (values * mask).detach().reshape(-1))
    return sums[index]


def _sequence_tokens(inputs: TokenInputs, dtype: torch.dtype) -> torch.Tensor:
    tokens = inputs.sequence_tokens
    if tokens is None:
        tokens = inputs.mask.to(dtype).sum(dim=-1, keepdim=True)
    return tokens


def _sequence_mean(values: torch.Tensor, inputs: TokenInputs) -> torch.Tensor:
    """Each position's value replaced by the mean of its sequence's trained positions."""
    tokens = _sequence_tokens(inputs, values.dtype)
    return _sequence_sum(values, inputs) / tokens.clamp(min=1.0)


def _sampler_correction(
    old: torch.Tensor, inputs: TokenInputs, config: LossConfig
) -> dict[str, torch.Tensor]:
    """The correction's weight per position (no gradient) and its per-token statistics, of
    r = pi_old / mu at each trained token."""
    assert inputs.sampler_logprobs is not None
    zeros = torch.zeros_like(old)
    rho = _clamped(
        torch.where(inputs.mask, old.detach() - inputs.sampler_logprobs, zeros), symmetric=True
    )
    ratio = rho.exp()
    if config.correction_level is CorrectionLevel.SEQUENCE:
        if config.correction is Correction.TIS:
            measured = _clamped(_sequence_sum(rho, inputs), symmetric=True).exp()
        else:  # IcePop: the geometric mean; a product of many ratios leaves any band
            measured = _sequence_mean(rho, inputs).exp()
    else:
        measured = ratio
    if config.correction is Correction.TIS:
        weight = measured.clamp(max=config.tis_cap)
        corrected = measured > config.tis_cap
    else:
        kept = (measured >= config.icepop_low) & (measured <= config.icepop_high)
        weight = kept.to(old.dtype)
        corrected = ~kept
    return {
        "weight": weight,
        "corrected": corrected.to(old.dtype),
        "ratio": ratio,
        # k3 = r - 1 - log r, written so that it keeps its precision for r near 1 (where it is
        # rho^2 / 2): r - 1 - rho in float32 cancels to rounding noise of either sign there.
        "kl": (torch.expm1(rho) - rho).clamp(min=0.0),
    }


def _clipped_objective(
    ratio: torch.Tensor, advantages: torch.Tensor, config: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic clipped loss per token, with dual clip for negative advantages;
    and whether each token's clipped branch was taken."""
    clipped_ratio = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    unclipped = -advantages * ratio
    clipped = -advantages * clipped_ratio
    policy = torch.maximum(unclipped, clipped)
    taken = clipped > unclipped
    if config.dual_clip:
        bound = -advantages * config.dual_clip
        capped = (advantages < 0) & (policy > bound)
        policy = torch.where(capped, bound, policy)
        taken = taken | capped
    return policy, taken


def _per_token_terms(
    logprobs: torch.Tensor, inputs: TokenInputs, config: LossConfig
) -> dict[str, torch.Tensor]:
    zeros = torch.zeros_like(logprobs)
    if config.kind is LossKind.CROSS_ENTROPY:
        terms = {"policy": -logprobs, "clipped": zeros, "ratio": zeros}
    else:
        assert inputs.advantages is not None
        advantages = inputs.advantages
        # pi_old: the behaviour logprobs sent, or else the step's own weights (with a sampler
        # correction): every microbatch of a step runs with the weights it began with.
        old = inputs.behaviour_logprobs
        if old is None:
            assert config.corrects_sampler, "behaviour_logprobs are required without a correction"
            old = logprobs.detach()
        log_ratio = torch.where(inputs.mask, logprobs - old, zeros)
        if config.kind is LossKind.GSPO:
            # The sequence's log ratio as the value, the token's own log-probability as the
            # gradient: exp(sg(log s) + log p - sg(log p)).
            sequence = _clamped(_sequence_mean(log_ratio, inputs), symmetric=True)
            ratio = (sequence + logprobs - logprobs.detach()).exp()
        else:
            ratio = _clamped(log_ratio, symmetric=True).exp()
        if config.kind is LossKind.CISPO:
            weight = ratio.detach().clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
            policy = -weight * advantages * logprobs
            taken = weight != ratio.detach()
        else:
            policy, taken = _clipped_objective(ratio, advantages, config)
        terms = {
            "policy": policy,
            "clipped": taken.to(logprobs.dtype).detach(),
            "ratio": ratio.detach(),
        }
        if config.corrects_sampler:
            correction = _sampler_correction(old, inputs, config)
            terms["policy"] = policy * correction["weight"]
            terms.update({f"sampler_{k}": v for k, v in correction.items()})
    if config.needs_reference:
        assert inputs.reference_logprobs is not None
        delta = torch.where(inputs.mask, inputs.reference_logprobs - logprobs, zeros)
        delta = _clamped(delta, symmetric=False)
        terms["kl"] = delta.exp() - delta - 1.0
    else:
        terms["kl"] = zeros
    return terms


def loss_sums(
    logprobs: torch.Tensor,
    inputs: TokenInputs,
    config: LossConfig,
    entropy: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Scalar sums over the microbatch; ``loss`` carries the gradient, the rest are detached.

    Token and constant normalization sum over valid tokens (the step divides by the token
    count, or by the constant length times the sequence count); sequence normalization sums
    each sequence's token mean. Metrics that are per-token by nature (clip fraction, ratio,
    entropy) always sum over tokens. `entropy` (per position) is needed for an entropy bonus,
    and reported whenever given.
    """
    mask = inputs.mask.to(logprobs.dtype)
    terms = _per_token_terms(logprobs, inputs, config)
    if config.normalization is Normalization.SEQUENCE:
        counts = inputs.sequence_tokens
        if counts is None:
            counts = mask.sum(dim=-1, keepdim=True)
        weights = mask / counts.clamp(min=1.0)
    else:
        weights = mask
    policy = (terms["policy"] * weights).sum()
    kl = (terms["kl"] * weights).sum()
    loss = policy + config.kl_coef * kl if config.needs_reference else policy
    entropy_sum = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    if entropy is not None:
        entropy_sum = (entropy * mask).sum().detach()
    if config.entropy_coef:
        assert entropy is not None, "an entropy bonus needs the policy's entropy"
        loss = loss - config.entropy_coef * (entropy * weights).sum()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    sampler = {"sampler_ratio": zero, "corrected_tokens": zero, "mismatch_kl": zero}
    extremes = {"sampler_ratio_max": zero, "sampler_ratio_neg_min": zero}
    if "sampler_ratio" in terms:
        ratio = terms["sampler_ratio"]
        sampler = {
            "sampler_ratio": (ratio * mask).sum(),
            "corrected_tokens": (terms["sampler_corrected"] * mask).sum(),
            "mismatch_kl": (terms["sampler_kl"] * mask).sum(),
        }
        # Over trained tokens only (ratios are > 0; -inf never wins a maximum).
        lowest = torch.full_like(ratio, float("-inf"))
        extremes = {
            "sampler_ratio_max": torch.where(inputs.mask, ratio, zero).max(),
            "sampler_ratio_neg_min": torch.where(inputs.mask, -ratio, lowest).max(),
        }
    return {
        "loss": loss,
        "policy": policy.detach(),
        "kl": kl.detach(),
        "clipped_tokens": (terms["clipped"] * mask).sum(),
        "ratio": (terms["ratio"] * mask).sum(),
        "valid_tokens": mask.sum(),
        "entropy": entropy_sum,
        **sampler,
        **extremes,
    }
