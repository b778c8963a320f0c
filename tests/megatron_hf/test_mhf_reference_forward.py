"""Ground truth: a forward pass written against the Megatron layout equals HF's logits.

The reference restates Megatron-core's local-spec GPT forward (fused QKV split per query group,
q/k layernorm per head, rotary, GQA, SwiGLU as silu(first half of fc1) * second half), so a
conversion that round-trips but misplaces rows (gate/up swapped, wrong group order) fails here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from megatron_hf.checkpoint import load_hf_state_dict
from megatron_hf.convert import hf_to_megatron
from megatron_hf.spec import ModelSpec, padded_vocab_size

TOKENS = torch.tensor([[1, 23, 24, 17, 25, 26, 35, 26, 28, 5, 40]])


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Non-interleaved rotary on [seq, heads, dim] (Megatron's default, as HF Llama/Qwen)."""
    seq, dim = x.shape[0], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * emb.cos() + torch.cat([-x2, x1], dim=-1) * emb.sin()


def megatron_reference_logits(
    meg: dict[str, torch.Tensor], spec: ModelSpec, tokens: torch.Tensor
) -> torch.Tensor:
    eps, groups, per_group, hd = (
        spec.rms_norm_eps,
        spec.num_query_groups,
        spec.heads_per_group,
        spec.head_dim,
    )
    x = meg["embedding.word_embeddings.weight"][tokens[0]]  # [s, h]
    seq = x.shape[0]
    for i in range(spec.num_layers):
        p = f"decoder.layers.{i}."
        h = _rms(x, meg[p + "input_layernorm.weight"], eps)
        mixed = h @ meg[p + "self_attention.linear_qkv.weight"].T
        if spec.qkv_bias:
            mixed = mixed + meg[p + "self_attention.linear_qkv.bias"]
        mixed = mixed.view(seq, groups, (per_group + 2) * hd)
        q, k, v = torch.split(mixed, [per_group * hd, hd, hd], dim=-1)
        q = q.reshape(seq, groups * per_group, hd)
        if spec.qk_layernorm:
            q = _rms(q, meg[p + "self_attention.q_layernorm.weight"], eps)
            k = _rms(k, meg[p + "self_attention.k_layernorm.weight"], eps)
        q, k = _rotate(q, spec.rope_theta), _rotate(k, spec.rope_theta)
        # query head n attends with key/value group n // per_group
        k = k.repeat_interleave(per_group, dim=1)
        v = v.repeat_interleave(per_group, dim=1)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        ctx = attn.transpose(0, 1).reshape(seq, -1)
        x = x + ctx @ meg[p + "self_attention.linear_proj.weight"].T
        h = _rms(x, meg[p + "pre_mlp_layernorm.weight"], eps)
        x_glu, x_linear = torch.chunk(h @ meg[p + "mlp.linear_fc1.weight"].T, 2, dim=-1)
        x = x + (F.silu(x_glu) * x_linear) @ meg[p + "mlp.linear_fc2.weight"].T
    x = _rms(x, meg["decoder.final_layernorm.weight"], eps)
    out = meg.get("output_layer.weight", meg["embedding.word_embeddings.weight"])
    return (x @ out.T)[None, :, : spec.vocab_size]


def _hf_logits(path: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(TOKENS).logits


def test_megatron_layout_forward_matches_hf(
    tiny_checkpoint: Callable[[str], Path], variant: str
) -> None:
    path = tiny_checkpoint(variant)
    spec = ModelSpec.from_pretrained_dir(path)
    meg = hf_to_megatron(load_hf_state_dict(path), spec, padded_vocab_size(spec.vocab_size, 2))
    expected = _hf_logits(path)
    with torch.no_grad():
        got = megatron_reference_logits(meg, spec, TOKENS)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_reference_detects_swapped_gate_up(tiny_checkpoint: Callable[[str], Path]) -> None:
    path = tiny_checkpoint("llama")
    spec = ModelSpec.from_pretrained_dir(path)
    meg = hf_to_megatron(load_hf_state_dict(path), spec, 128)
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    gate, up = meg[name].chunk(2)
    meg[name] = torch.cat([up, gate])
    with torch.no_grad():
        got = megatron_reference_logits(meg, spec, TOKENS)
    assert not torch.allclose(got, _hf_logits(path), rtol=1e-4, atol=1e-5)
