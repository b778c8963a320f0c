"""HF <-> Megatron-core (local spec) state-dict translation for Llama / Qwen2 / Qwen3 (and
Qwen3-MoE, whose router and experts `experts` names).

State dicts here are global: unsharded (TP=1 layout) with global layer indices. The mapping is
the tables below plus the fused-tensor helpers; everything else is bookkeeping and validation.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from megatron_hf import experts
from megatron_hf.fused import fuse_gate_up, fuse_qkv, split_gate_up, split_qkv
from megatron_hf.spec import ModelSpec

__all__ = [
    "check_hf_shapes",
    "fuse_gate_up",
    "fuse_qkv",
    "hf_names",
    "hf_names_of",
    "hf_shape",
    "hf_to_megatron",
    "megatron_names",
    "megatron_param_to_hf",
    "megatron_to_hf",
    "split_gate_up",
    "split_qkv",
]

# Per-layer 1:1 renames, Megatron suffix (under `decoder.layers.{i}.`) -> HF suffix (under
# `model.layers.{i}.`). Listed in Megatron's parameter order.
LAYER_RENAMES: dict[str, str] = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}

# Fused Megatron tensors -> the HF tensors they concatenate (see fuse_qkv / fuse_gate_up).
LAYER_FUSED: dict[str, tuple[str, ...]] = {
    "self_attention.linear_qkv.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "self_attention.linear_qkv.bias": (
        "self_attn.q_proj.bias",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.bias",
    ),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}

# TE-spec layer names (norm fused into the following linear) -> local-spec names.
TE_ALIASES: dict[str, str] = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}

GLOBAL_RENAMES: dict[str, str] = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}

# Megatron pads these along dim 0 to the padded vocab; HF holds exactly spec.vocab_size rows.
VOCAB_PADDED = frozenset({"embedding.word_embeddings.weight", "output_layer.weight"})

_HF_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _split_layer_name(name: str) -> tuple[int, str] | None:
    """`decoder.layers.3.mlp.x` -> (3, "mlp.x"); None for other names (no wrapper prefixes)."""
    match = _LAYER_RE.match(name)
    return (int(match[1]), match[2]) if match else None


def _layer_suffixes(spec: ModelSpec) -> list[str]:
    """Megatron per-layer names in GPTModel.named_parameters() order."""
    names = [
        "input_layernorm.weight",
        "self_attention.linear_proj.weight",
        "self_attention.linear_qkv.weight",
    ]
    if spec.qkv_bias:
        names.append("self_attention.linear_qkv.bias")
    if spec.qk_layernorm:
        names += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    names.append("pre_mlp_layernorm.weight")
    if spec.moe is not None:
        return names + experts.moe_layer_suffixes(spec)
    return [*names, "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]


def _is_fc1(suffix: str) -> bool:
    """A [gate; up] tensor: the dense MLP's fc1 or an expert's."""
    if suffix == "mlp.linear_fc1.weight":
        return True
    param = experts.parse_expert_suffix(suffix)
    return param is not None and param.fc == 1


def megatron_names(spec: ModelSpec) -> list[str]:
    """Every Megatron parameter name of the model (global indices, local-spec naming)."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(spec.num_layers):
        names += [f"decoder.layers.{i}.{s}" for s in _layer_suffixes(spec)]
    names.append("decoder.final_layernorm.weight")
    if not spec.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


def hf_names_of(megatron_name: str, spec: ModelSpec | None = None) -> tuple[str, ...]:
    """HF names produced from one Megatron name (local or TE spec), in fused order. Expert
    tensors take the spec's family's names (Qwen3-MoE's without a spec)."""
    if megatron_name in GLOBAL_RENAMES:
        return (GLOBAL_RENAMES[megatron_name],)
    parsed = _split_layer_name(megatron_name)
    if parsed is not None:
        index, suffix = parsed
        suffix = TE_ALIASES.get(suffix, suffix)
        if suffix in LAYER_RENAMES:
            return (f"model.layers.{index}.{LAYER_RENAMES[suffix]}",)
        if suffix in LAYER_FUSED:
            return tuple(f"model.layers.{index}.{s}" for s in LAYER_FUSED[suffix])
        moe = experts.hf_suffixes_of(suffix, spec.family if spec is not None else None)
        if moe is not None:
            return tuple(f"model.layers.{index}.{s}" for s in moe)
    raise ValueError(f"no HF counterpart for Megatron name {megatron_name!r}")


def hf_names(spec: ModelSpec) -> list[str]:
    """Every HF parameter name of the model as saved (lm_head omitted when tied)."""
    return [h for name in megatron_names(spec) for h in hf_names_of(name, spec)]


def hf_shape(hf_name: str, spec: ModelSpec) -> tuple[int, ...]:
    """Shape of an HF parameter of this model."""
    h, d, f = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    q_rows, kv_rows = spec.num_attention_heads * d, spec.num_query_groups * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "lm_head.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q_rows, h),
        "self_attn.k_proj.weight": (kv_rows, h),
        "self_attn.v_proj.weight": (kv_rows, h),
        "self_attn.q_proj.bias": (q_rows,),
        "self_attn.k_proj.bias": (kv_rows,),
        "self_attn.v_proj.bias": (kv_rows,),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "self_attn.o_proj.weight": (h, q_rows),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
    }
    key = hf_name.split(".", 3)[3] if hf_name.startswith("model.layers.") else hf_name
    moe = experts.hf_expert_shape(key, spec)
    if moe is not None:
        return moe
    if key not in shapes:
        raise ValueError(f"unknown HF parameter {hf_name!r}")
    return shapes[key]


def _check_hf_shape(hf_name: str, shape: tuple[int, ...], spec: ModelSpec) -> None:
    expected = hf_shape(hf_name, spec)
    if shape != expected:
        raise ValueError(f"{hf_name} has shape {shape}, expected {expected} for this model spec")


def check_hf_shapes(shapes: Mapping[str, tuple[int, ...]], spec: ModelSpec) -> None:
    """An HF checkpoint's tensor names and shapes (``name -> shape``) against the model: none
    missing, none unexpected, each of its shape."""
    needed = hf_names(spec)
    known = set(needed) | ({"lm_head.weight"} if spec.tie_word_embeddings else set())
    extra = sorted(k for k in shapes if k not in known and not k.endswith(_HF_IGNORED_SUFFIXES))
    _check_names("HF", missing=[k for k in needed if k not in shapes], unexpected=extra)
    for hf_name in needed:
        _check_hf_shape(hf_name, tuple(shapes[hf_name]), spec)


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor], spec: ModelSpec, padded_vocab: int
) -> dict[str, torch.Tensor]:
    """HF state dict -> global Megatron state dict; padded vocab rows are zeros."""
    if padded_vocab < spec.vocab_size:
        raise ValueError(f"padded_vocab {padded_vocab} < vocab_size {spec.vocab_size}")
    check_hf_shapes({name: tuple(tensor.shape) for name, tensor in hf.items()}, spec)
    out: dict[str, torch.Tensor] = {}
    for name in megatron_names(spec):
        sources = [hf[h] for h in hf_names_of(name, spec)]
        out[name] = _to_megatron_tensor(name, sources, spec, padded_vocab)
    return out


def _to_megatron_tensor(
    name: str, sources: list[torch.Tensor], spec: ModelSpec, padded_vocab: int
) -> torch.Tensor:
    suffix = name if name in GLOBAL_RENAMES else name.split(".", 3)[3]
    if suffix.startswith("self_attention.linear_qkv."):
        q, k, v = sources
        return fuse_qkv(
            q,
            k,
            v,
            num_attention_heads=spec.num_attention_heads,
            num_query_groups=spec.num_query_groups,
            head_dim=spec.head_dim,
        )
    if _is_fc1(suffix):
        return fuse_gate_up(*sources)
    (tensor,) = sources
    if name in VOCAB_PADDED and padded_vocab > spec.vocab_size:
        padded = tensor.new_zeros((padded_vocab, spec.hidden_size))
        padded[: spec.vocab_size] = tensor
        return padded
    return tensor


def megatron_param_to_hf(
    megatron_name: str, tensor: torch.Tensor, spec: ModelSpec
) -> dict[str, torch.Tensor]:
    """One global Megatron parameter (local or TE name) -> its HF tensor(s).

    Vocab-padded rows are trimmed; results may be views of `tensor`.
    """
    out = _param_to_hf(megatron_name, tensor, spec)
    for hf_name, hf_tensor in out.items():
        _check_hf_shape(hf_name, tuple(hf_tensor.shape), spec)
    return out


def _param_to_hf(
    megatron_name: str, tensor: torch.Tensor, spec: ModelSpec
) -> dict[str, torch.Tensor]:
    hf = hf_names_of(megatron_name, spec)
    parsed = _split_layer_name(megatron_name)
    suffix = TE_ALIASES.get(parsed[1], parsed[1]) if parsed else megatron_name
    if spec.moe is None and experts.hf_suffixes_of(suffix) is not None:
        raise ValueError(f"no HF counterpart for Megatron name {megatron_name!r} in a dense model")
    if suffix.startswith("self_attention.linear_qkv."):
        parts = split_qkv(
            tensor,
            num_attention_heads=spec.num_attention_heads,
            num_query_groups=spec.num_query_groups,
            head_dim=spec.head_dim,
        )
        return dict(zip(hf, parts, strict=True))
    if _is_fc1(suffix):
        return dict(zip(hf, split_gate_up(tensor), strict=True))
    if megatron_name in VOCAB_PADDED:
        if tensor.dim() != 2 or tensor.shape[0] < spec.vocab_size:
            raise ValueError(
                f"{megatron_name} has shape {tuple(tensor.shape)}; expected at least "
                f"{spec.vocab_size} vocab rows"
            )
        tensor = tensor[: spec.vocab_size]
    return {hf[0]: tensor}


def megatron_to_hf(meg: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Global Megatron state dict -> HF state dict (HF model order).

    Drops `_extra_state` entries, accepts TE-spec norm names, trims padded vocab rows and,
    when embeddings are tied, ignores an `output_layer.weight` copy (PP last stage has one).
    """
    canonical: dict[str, torch.Tensor] = {}
    for name, tensor in meg.items():
        if name.endswith("_extra_state"):
            continue
        if spec.tie_word_embeddings and name == "output_layer.weight":
            continue
        local = local_spec_name(name)
        if local in canonical:
            raise ValueError(f"{local!r} given twice (local-spec and TE-spec names both present)")
        canonical[local] = tensor
    needed = megatron_names(spec)
    _check_names(
        "Megatron",
        missing=[n for n in needed if n not in canonical],
        unexpected=sorted(set(canonical) - set(needed)),
    )
    out: dict[str, torch.Tensor] = {}
    for name in needed:
        out.update(megatron_param_to_hf(name, canonical[name], spec))
    return out


def local_spec_name(name: str) -> str:
    """The local-spec name of a parameter given under its TE-spec name (others unchanged)."""
    parsed = _split_layer_name(name)
    if parsed is None:
        return name
    if parsed[1] in TE_ALIASES:
        return f"decoder.layers.{parsed[0]}.{TE_ALIASES[parsed[1]]}"
    return f"decoder.layers.{parsed[0]}.{experts.canonical_suffix(parsed[1])}"


def _check_names(side: str, *, missing: list[str], unexpected: list[str]) -> None:
    if not missing and not unexpected:
        return
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} (e.g. {missing[:5]})")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} (e.g. {unexpected[:5]})")
    raise ValueError(f"{side} state dict does not match the model spec: " + "; ".join(problems))
