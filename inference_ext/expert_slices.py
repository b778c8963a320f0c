"""Where a vLLM worker's fused expert tensors live in the trainer's grouped expert tensors.

vLLM (0.32) holds a mixture-of-experts layer's experts in two fused parameters: `w13_weight`
[E_w, 2*I_w, H], each expert's [gate rows; up rows], and `w2_weight` [E_w, H, I_w] (down).
Which experts and which part of their width a worker holds is `slices.expert_share`. The
trainer publishes each layer's experts grouped: linear_fc1 [E, 2I, H] (expert e's [gate; up])
and linear_fc2 [E, H, I]. So a worker's w13 is its experts' box of fc1 and its w2 one box of
fc2: two reads per layer, whatever the number of experts. Where TP splits the experts' width,
w13 is two boxes of fc1 (its gate rows and its up rows of all its experts at once): three. A
worker holding whole experts reads fc1's rows as they lie, so its w13 is staging's bytes as
they landed (a view, and a tensor an engine can keep in staging: `staged_tensors.py`).

A receiver's expert targets are named after vLLM's fused parameters (`EXPERT_TARGET`, e.g.
``model.layers.3.mlp.experts.w13_weight``; Mixtral's under ``block_sparse_moe.experts``) and
have the worker's local shape, so the box it installs is the whole tensor. They replace the
HF checkpoint's per-expert tensors in the receiver's names (`receiver_names`), after every
other name: the installer hands the others to vLLM's reload first and installs the experts
itself (`fused_experts.py`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from inference_ext.slices import ReceiverLayout, expert_share
from inference_ext.translate import Source
from megatron_hf.experts import grouped_expert_name, hf_expert_names
from megatron_hf.spec import ModelSpec
from refit_sidecar.core.manifest import Box


class FusedExpertTensor(Enum):
    """vLLM's fused expert parameters of a layer."""

    W13 = "w13_weight"
    """[experts, 2 * width, hidden]: each expert's gate rows, then its up rows."""
    W2 = "w2_weight"
    """[experts, hidden, width]: each expert's down projection."""


@dataclass(frozen=True)
class ExpertTarget:
    """One fused expert tensor of decoder layer `layer`."""

    layer: int
    tensor: FusedExpertTensor


_TARGET_RE = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(w13|w2)_weight$"
)


def target_name(spec: ModelSpec, target: ExpertTarget) -> str:
    prefix = hf_expert_names(spec.family).experts
    return f"model.layers.{target.layer}.{prefix}.{target.tensor.value}"


def parse_target(name: str) -> ExpertTarget | None:
    """The expert target a receiver name is; None for any other name (an HF tensor's)."""
    match = _TARGET_RE.match(name)
    if match is None:
        return None
    return ExpertTarget(int(match[1]), FusedExpertTensor(f"{match[2]}_weight"))


def receiver_names(spec: ModelSpec, hf_names: Sequence[str]) -> list[str]:
    """A receiver's names for a model with HF names `hf_names`: for a mixture of experts the
    HF names without the per-expert tensors, then each layer's w13 and w2 targets (adjacent:
    the installer processes a layer's pair together)."""
    if spec.moe is None:
        return list(hf_names)
    experts = hf_expert_names(spec.family).experts
    per_expert = re.compile(rf"^model\.layers\.\d+\.{re.escape(experts)}\.\d+\.")
    kept = [name for name in hf_names if not per_expert.match(name)]
    targets = [
        target_name(spec, ExpertTarget(layer, tensor))
        for layer in range(spec.num_layers)
        for tensor in FusedExpertTensor
    ]
    return [*kept, *targets]


def target_shape(spec: ModelSpec, layout: ReceiverLayout, target: ExpertTarget) -> tuple[int, ...]:
    """The worker's local shape of `target` (vLLM's parameter shape before any padding)."""
    assert spec.moe is not None
    share = expert_share(spec, layout)
    if target.tensor is FusedExpertTensor.W13:
        return (share.num_experts, 2 * share.width_size, spec.hidden_size)
    return (share.num_experts, spec.hidden_size, share.width_size)


def expert_sources(spec: ModelSpec, layout: ReceiverLayout, target: ExpertTarget) -> list[Source]:
    """The boxes of the grouped Megatron tensors that make up the worker's `target`, each with
    the sub-box of the target it fills: w13's gate rows and up rows (two boxes of fc1, every
    expert of the worker in each; one box, fc1's rows as they lie, where the worker holds the
    experts' whole width), w2's columns (one box of fc2)."""
    if spec.moe is None:
        raise ValueError(f"{spec.architecture} has no experts")
    if not 0 <= target.layer < spec.num_layers:
        raise ValueError(f"no layer {target.layer}: the model has {spec.num_layers} layers")
    share = expert_share(spec, layout)
    width, hidden = spec.moe.ffn_hidden_size, spec.hidden_size
    local_experts, local_width = (0, share.num_experts), share.width_size
    if target.tensor is FusedExpertTensor.W2:
        name = grouped_expert_name(target.layer, 2)
        box = Box((share.experts, (0, hidden), share.width))
        return [Source(name, box, Box((local_experts, (0, hidden), (0, local_width))))]
    name = grouped_expert_name(target.layer, 1)
    if share.width == (0, width):  # expert e's fc1 rows are [gate; up]: w13's own order
        box = Box((share.experts, (0, 2 * width), (0, hidden)))
        return [Source(name, box, Box((local_experts, (0, 2 * width), (0, hidden))))]
    sources = []
    for part in range(2):  # gate, then up: expert e's fc1 rows are [gate (width); up (width)]
        rows = (part * width + share.width[0], part * width + share.width[1])
        local_rows = (part * local_width, (part + 1) * local_width)
        sources.append(
            Source(
                name,
                Box((share.experts, rows, (0, hidden))),
                Box((local_experts, local_rows, (0, hidden))),
            )
        )
    return sources
