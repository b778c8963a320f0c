"""Loss sums of one laid-out microbatch (`runtime/packing.py`: padded rows or one packed row).
Sums, never means: the step divides by the global count once, at finish, so any split of the
batch gives the same gradient."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer_svc.domain import LossConfig, LossKind, Normalization

SUM_FIELDS = ("loss", "policy", "kl", "clipped_tokens", "ratio", "valid_tokens")

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


def _per_token_terms(
    logprobs: torch.Tensor, inputs: TokenInputs, config: LossConfig
) -> dict[str, torch.Tensor]:
    zeros = torch.zeros_like(logprobs)
    if config.kind is LossKind.CROSS_ENTROPY:
        terms = {"policy": -logprobs, "clipped": zeros, "ratio": zeros}
    else:
        assert inputs.advantages is not None and inputs.behaviour_logprobs is not None
        log_ratio = torch.where(inputs.mask, logprobs - inputs.behaviour_logprobs, zeros)
        ratio = _clamped(log_ratio, symmetric=True).exp()
        clipped_ratio = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
        unclipped = -inputs.advantages * ratio
        clipped = -inputs.advantages * clipped_ratio
        terms = {
            "policy": torch.maximum(unclipped, clipped),
            "clipped": (clipped > unclipped).to(logprobs.dtype).detach(),
            "ratio": ratio.detach(),
        }
    if config.needs_reference:
        assert inputs.reference_logprobs is not None
        delta = torch.where(inputs.mask, inputs.reference_logprobs - logprobs, zeros)
        delta = _clamped(delta, symmetric=False)
        terms["kl"] = delta.exp() - delta - 1.0
    else:
        terms["kl"] = zeros
    return terms


def loss_sums(
    logprobs: torch.Tensor, inputs: TokenInputs, config: LossConfig
) -> dict[str, torch.Tensor]:
    """Scalar sums over the microbatch; ``loss`` carries the gradient, the rest are detached.

    Token normalization sums over valid tokens; sequence normalization sums each row's token
    mean. Metrics that are per-token by nature (clip fraction, ratio) always sum over tokens.
    """
    mask = inputs.mask.to(logprobs.dtype)
    terms = _per_token_terms(logprobs, inputs, config)
    if config.normalization is Normalization.TOKEN:
        weights = mask
    else:
        counts = inputs.sequence_tokens
        if counts is None:
            counts = mask.sum(dim=-1, keepdim=True)
        weights = mask / counts.clamp(min=1.0)
    policy = (terms["policy"] * weights).sum()
    kl = (terms["kl"] * weights).sum()
    loss = policy + config.kl_coef * kl if config.needs_reference else policy
    return {
        "loss": loss,
        "policy": policy.detach(),
        "kl": kl.detach(),
        "clipped_tokens": (terms["clipped"] * mask).sum(),
        "ratio": (terms["ratio"] * mask).sum(),
        "valid_tokens": mask.sum(),
    }
