"""Tiny HF checkpoints built locally (no download) for tests, demos and the default model.

Every norm weight and bias is perturbed with seeded noise after init, so a conversion that
swaps, drops or misorders them is caught by a round trip or a logits comparison.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from megatron_hf.spec import ModelFamily, MoESpec

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0..3
# Printable ASCII plus tab and newline: 0-9, a-z, A-Z, space, punctuation and operators.
CHARACTERS = "\t\n" + "".join(chr(c) for c in range(0x20, 0x7F))

_MODEL_CLASSES: dict[ModelFamily, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    ModelFamily.LLAMA: (LlamaConfig, LlamaForCausalLM),
    ModelFamily.QWEN2: (Qwen2Config, Qwen2ForCausalLM),
    ModelFamily.QWEN3: (Qwen3Config, Qwen3ForCausalLM),
    ModelFamily.MISTRAL: (MistralConfig, MistralForCausalLM),
    ModelFamily.QWEN3_MOE: (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    ModelFamily.MIXTRAL: (MixtralConfig, MixtralForCausalLM),
}

TINY_EXPERTS = MoESpec(num_experts=8, top_k=2, ffn_hidden_size=32, norm_topk_prob=True)
"""The experts of a tiny MoE checkpoint unless others are asked for: 8 split over EP 1, 2, 4
or 8, and their width 32 over ETP 2 or 4."""


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer over printable ASCII, tab and newline.

    It is a byte-level BPE without merges, built exactly as transformers 5 rebuilds Qwen2
    tokenizers (AutoTokenizer forces Qwen2Tokenizer for model_type qwen2), so every family
    tokenizes identically. Characters outside the alphabet are dropped, not mapped to <unk>.
    """
    byte_chars = _bytes_to_unicode()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in CHARACTERS:
        vocab[byte_chars[ord(char)]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write_tiny_checkpoint(
    path: str | Path,
    family: ModelFamily = ModelFamily.LLAMA,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    head_dim: int | None = None,
    max_position_embeddings: int = 256,
    rope_scaling: Mapping[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int | None = None,
    experts: MoESpec | None = None,
) -> Path:
    """Write a seeded random model + tokenizer to `path`; returns `path`.

    `rope_scaling` is an HF RoPE dict (`megatron_hf.rope`); a scaled model's
    max_position_embeddings is its extended length, as in HF's long-context configs. The weights
    are drawn in float32 and saved in `dtype`; `max_shard_bytes` splits them into several files
    with an index, as large checkpoints ship. `experts` sets a mixture-of-experts family's
    experts (default `TINY_EXPERTS`); a dense family refuses them."""
    default_head_dim = hidden_size // num_attention_heads
    if hidden_size % num_attention_heads and head_dim is None:
        raise ValueError(
            f"hidden_size ({hidden_size}) is not divisible by num_attention_heads "
            f"({num_attention_heads}); pass head_dim explicitly"
        )
    if family is ModelFamily.QWEN2 and head_dim not in (None, default_head_dim):
        raise ValueError("Qwen2 has no head_dim setting; head_dim must be hidden/heads")
    tokenizer = build_tokenizer()
    config_cls, model_cls = _MODEL_CLASSES[family]
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    fields: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "rms_norm_eps": 1e-6,
        "dtype": str(dtype).removeprefix("torch."),
        **ids,
    }
    if rope_scaling is not None:
        fields["rope_scaling"] = dict(rope_scaling)
    if family in (ModelFamily.MISTRAL, ModelFamily.MIXTRAL):
        fields["sliding_window"] = None
    if family is not ModelFamily.QWEN2:
        fields["head_dim"] = head_dim or default_head_dim
    if family is ModelFamily.QWEN3_MOE:
        moe = experts or TINY_EXPERTS
        fields.update(
            num_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            moe_intermediate_size=moe.ffn_hidden_size,
            norm_topk_prob=moe.norm_topk_prob,
        )
    elif family is ModelFamily.MIXTRAL:
        moe = experts or TINY_EXPERTS
        if not moe.norm_topk_prob:
            raise ValueError("Mixtral always renormalises its top-k: norm_topk_prob must be True")
        fields.update(
            num_local_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            intermediate_size=moe.ffn_hidden_size,
        )
    elif experts is not None:
        raise ValueError(f"{family.value} has no experts")
    config = config_cls(**fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
        model.float()
    _perturb_norms_and_biases(model, seed)
    model.generation_config = GenerationConfig(**ids)
    model.to(dtype)
    out = Path(path)
    model.save_pretrained(out, max_shard_size=max_shard_bytes or "5GB")
    tokenizer.save_pretrained(out)
    return out


def _perturb_norms_and_biases(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):
                # A decisive router: clear gaps between the experts' scores, so that float
                # noise in two implementations does not change which experts a token takes.
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
