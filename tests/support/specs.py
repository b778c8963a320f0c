"""A synthetic model spec for tests that need shapes, not weights."""

from __future__ import annotations

import dataclasses

from megatron_hf.spec import ModelFamily, ModelSpec


def synthetic_spec(**changes: object) -> ModelSpec:
    """A Llama spec (2 layers, hidden 64, 4 heads of 16, 2 KV heads, vocab 101, untied) with
    `changes`."""
    base = ModelSpec(
        family=ModelFamily.LLAMA,
        architecture="LlamaForCausalLM",
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=16,
        vocab_size=101,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qkv_bias=False,
        qk_layernorm=False,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]
