"""Where a box of an HF tensor lives in the Megatron tensors: the inverse of
`megatron_hf.convert`, on boxes instead of whole tensors, so a receiver can pull only the part
it needs.

Coordinates on both sides are global (unsharded, global layer indices). A box of q_proj rows
may span several query groups, and each group's rows sit apart in the fused linear_qkv, so one
HF box can come from several Megatron boxes (`Source`s), each landing at its own sub-box.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_hf.convert import GLOBAL_RENAMES, LAYER_FUSED, LAYER_RENAMES, hf_shape
from megatron_hf.experts import ROUTER, hf_expert_names
from megatron_hf.spec import ModelSpec
from refit_sidecar.core.manifest import Box

# HF suffix -> (Megatron suffix, index of the part in the fused tensor).
_LAYER_SOURCES: dict[str, tuple[str, int]] = {
    **{hf: (meg, 0) for meg, hf in LAYER_RENAMES.items()},
    **{hf: (meg, i) for meg, parts in LAYER_FUSED.items() for i, hf in enumerate(parts)},
}
_GLOBAL_SOURCES: dict[str, str] = {hf: meg for meg, hf in GLOBAL_RENAMES.items()}
_LAYER_PREFIX = "model.layers."


@dataclass(frozen=True)
class Source:
    """`megatron_box` of Megatron tensor `megatron_name` holds `hf_box` of the HF tensor."""

    megatron_name: str
    megatron_box: Box
    hf_box: Box


def megatron_part(hf_name: str, spec: ModelSpec) -> tuple[str, int]:
    """(Megatron name, part index) holding HF tensor `hf_name`; part > 0 only for fused
    tensors (k = 1 and v = 2 in linear_qkv, up = 1 in linear_fc1). With tied embeddings the
    LM head is the word embedding. A mixture-of-experts layer's router is one tensor on both
    sides; its experts are no HF tensors of a receiver (`expert_slices`)."""
    if hf_name in _GLOBAL_SOURCES:
        name = _GLOBAL_SOURCES[hf_name]
        if name == "output_layer.weight" and spec.tie_word_embeddings:
            name = "embedding.word_embeddings.weight"
        return name, 0
    if hf_name.startswith(_LAYER_PREFIX):
        index, _, suffix = hf_name[len(_LAYER_PREFIX) :].partition(".")
        router = spec.moe is not None and suffix == hf_expert_names(spec.family).router
        if index.isdigit() and (suffix in _LAYER_SOURCES or router):
            if int(index) >= spec.num_layers:
                raise ValueError(
                    f"no Megatron counterpart for HF name {hf_name!r}: the model has "
                    f"{spec.num_layers} layers"
                )
            meg_suffix, part = (ROUTER, 0) if router else _LAYER_SOURCES[suffix]
            return f"decoder.layers.{int(index)}.{meg_suffix}", part
    raise ValueError(f"no Megatron counterpart for HF name {hf_name!r}")


def megatron_sources(hf_name: str, box: Box, spec: ModelSpec) -> list[Source]:
    """The Megatron boxes that hold `box` of HF tensor `hf_name`, covering it exactly once."""
    if not box.within(hf_shape(hf_name, spec)):
        raise ValueError(f"{hf_name}: box {box} is outside {hf_shape(hf_name, spec)}")
    name, part = megatron_part(hf_name, spec)
    if name.endswith("self_attention.linear_qkv.weight") or name.endswith(
        "self_attention.linear_qkv.bias"
    ):
        return _qkv_sources(name, part, box, spec)
    if name.endswith("mlp.linear_fc1.weight"):
        return [Source(name, _shift_rows(box, part * spec.ffn_hidden_size), box)]
    return [Source(name, box, box)]


def _qkv_sources(name: str, part: int, box: Box, spec: ModelSpec) -> list[Source]:
    """q (part 0) holds heads_per_group heads per group, k and v one each; in linear_qkv
    group g's rows are [q heads, k, v] x head_dim starting at g * (heads_per_group + 2)."""
    d, per_group = spec.head_dim, spec.heads_per_group
    rows_in_group = (per_group if part == 0 else 1) * d
    offset_in_group = (0, per_group * d, (per_group + 1) * d)[part]
    group_stride = (per_group + 2) * d
    (lo, hi), rest = box.ranges[0], box.ranges[1:]
    sources = []
    for group in range(lo // rows_in_group, -(-hi // rows_in_group)):
        start = max(lo, group * rows_in_group)
        stop = min(hi, (group + 1) * rows_in_group)
        hf_box = Box(((start, stop), *rest))
        shift = group * group_stride + offset_in_group - group * rows_in_group
        sources.append(Source(name, _shift_rows(hf_box, shift), hf_box))
    return sources


def _shift_rows(box: Box, delta: int) -> Box:
    (lo, hi), rest = box.ranges[0], box.ranges[1:]
    return Box(((lo + delta, hi + delta), *rest))
