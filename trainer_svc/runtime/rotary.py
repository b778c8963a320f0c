"""transformers' RoPE in megatron's GPT model.

Megatron's `RotaryEmbedding` knows llama3 only with Llama 3.1's constants, and its YaRN class
computes other frequencies than transformers. The trainer therefore builds plain `rope` and
installs `megatron_hf.rope.inverse_frequencies` in every rotary module before the first forward;
YaRN's attention factor goes into the softmax scale. Whatever megatron version runs, the model
is checked at start, so it never trains with megatron's own frequencies unnoticed.
"""

from __future__ import annotations

import math

import torch

from megatron_hf.rope import attention_factor, inverse_frequencies
from megatron_hf.spec import ModelSpec


def softmax_scale(spec: ModelSpec) -> float | None:
    """The attention logits' scale, None for megatron's 1/sqrt(head_dim).

    transformers multiplies cos and sin by YaRN's attention factor m, so rotated queries and
    keys both grow by m and every q.k by m squared; megatron's rotary has no such factor, so
    the same logits come from scaling them by m^2 / sqrt(head_dim) instead."""
    factor = attention_factor(spec.rope_scaling)
    if factor == 1.0:
        return None
    return factor * factor / math.sqrt(spec.head_dim)


def install_frequencies(model: torch.nn.Module, spec: ModelSpec) -> None:
    """Replaces the inverse frequencies of every rotary module in `model` (each pipeline
    chunk has its own) with transformers', before any forward, and checks that the rotary
    embedding then computes from them. Raises RuntimeError where it cannot."""
    wanted = inverse_frequencies(spec.rope_scaling, spec.head_dim, spec.rope_theta)
    owners = [
        (owner, rotary)
        for owner in model.modules()
        if isinstance(rotary := getattr(owner, "rotary_pos_emb", None), torch.nn.Module)
    ]
    if not owners:
        raise RuntimeError("the model has no rotary_pos_emb to install RoPE frequencies in")
    for owner, rotary in owners:
        current = getattr(rotary, "inv_freq", None)
        if not isinstance(current, torch.Tensor) or current.shape != wanted.shape:
            raise RuntimeError(
                f"megatron's {type(rotary).__name__} has no inv_freq of shape "
                f"{tuple(wanted.shape)}; the trainer cannot give it transformers' "
                f"{spec.rope_scaling.kind.value} RoPE frequencies"
            )
        rotary.inv_freq = wanted.to(current.device)
        # Embeddings computed from the old frequencies: megatron memoises forward (lru_cache)
        # and keeps cos/sin for inference in the model.
        clear = getattr(type(rotary).forward, "cache_clear", None)
        if clear is not None:
            clear()
        cache = getattr(owner, "rotary_pos_emb_cache", None)
        if isinstance(cache, dict):
            cache.clear()
        _check_frequencies(rotary, wanted)


def check_softmax_scale(model: torch.nn.Module, spec: ModelSpec) -> None:
    """Every core attention (local, SDPA, or Transformer Engine's backends) scales its
    logits by `softmax_scale(spec)`; only checked where that differs from the default."""
    expected = softmax_scale(spec)
    if expected is None:
        return
    for owner in model.modules():
        core = getattr(owner, "core_attention", None)
        if core is None:
            continue
        scales = [
            m.softmax_scale
            for m in core.modules()
            if isinstance(getattr(m, "softmax_scale", None), float)
        ]
        if not scales or any(not math.isclose(s, expected, rel_tol=1e-12) for s in scales):
            raise RuntimeError(
                f"{type(core).__name__} scales attention logits by {scales or 'an unknown'}, "
                f"not YaRN's {expected}; use --attention sdpa"
            )


def _check_frequencies(rotary: torch.nn.Module, wanted: torch.Tensor) -> None:
    """Position 1's rotation angles are the inverse frequencies themselves (twice over, for
    the two halves of a head), whatever the embedding computes them from."""
    angles = rotary(2).reshape(2, -1)[1]
    expected = torch.cat([wanted, wanted]).to(angles.device)
    if not torch.equal(angles, expected):
        raise RuntimeError(
            f"megatron's {type(rotary).__name__} does not compute from the installed "
            f"inverse frequencies"
        )
