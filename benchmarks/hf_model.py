"""The transformers model a benchmark's receiver installs into: built from the run's config
directory, its parameters under the receiver's names, and an HF checkpoint's tensors as the
model holds them (what its installed weights are compared with).

transformers 5 holds a mixture-of-experts layer's experts fused in memory, its loading
converting the checkpoint's per-expert tensors: ``mlp.experts.gate_up_proj`` [E, 2I, H] (each
expert's gate rows, then its up rows) and ``mlp.experts.down_proj`` [E, H, I], the orientation
of vLLM's ``w13_weight``/``w2_weight``. So a receiver names them as refit's fused expert targets
(`inference_ext/expert_slices.py`); at TP=1 a target is the whole tensor, installed (or pulled
in place) as is. Mixtral's router and experts lie under ``mlp.`` in memory and under
``block_sparse_moe.`` in its checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from inference_ext.expert_slices import FusedExpertTensor, parse_target
from megatron_hf.experts import hf_expert_names
from megatron_hf.fused import stack_experts
from megatron_hf.spec import ModelFamily, ModelSpec

TRANSFORMERS_EXPERTS: dict[FusedExpertTensor, str] = {
    FusedExpertTensor.W13: "gate_up_proj",
    FusedExpertTensor.W2: "down_proj",
}
"""transformers' name of each fused expert tensor of a layer (under ``mlp.experts.``)."""


def build_hf_model(model_dir: str, dtype: str, device: str) -> Any:
    """The transformers model of the config directory, initialised on `device` in `dtype` (the
    trainer's; its random weights are overwritten by the first refit)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return model.to(device).eval()  # a no-op unless something was made elsewhere


def model_name(spec: ModelSpec, name: str) -> str:
    """The model's parameter of receiver name `name` (an HF name or a fused expert target)."""
    target = parse_target(name)
    if target is not None:
        return _fused_name(target.layer, target.tensor)
    if spec.family is ModelFamily.MIXTRAL:
        return name.replace(".block_sparse_moe.", ".mlp.", 1)
    return name


def _fused_name(layer: int, tensor: FusedExpertTensor) -> str:
    return f"model.layers.{layer}.mlp.experts.{TRANSFORMERS_EXPERTS[tensor]}"


def hf_parameters(model: Any, spec: ModelSpec, names: Sequence[str]) -> dict[str, Any]:
    """The model's parameters by receiver name; refuses a model whose parameters differ from
    them (a tied lm_head is the embedding and is never installed on its own)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    by_name = {name: model_name(spec, name) for name in names}
    tied = {"lm_head.weight"} if spec.tie_word_embeddings else set()
    missing = sorted(set(by_name.values()) - params.keys())
    extra = sorted(params.keys() - set(by_name.values()) - tied)
    if missing or extra:
        raise RuntimeError(
            f"HF model and receiver names differ: missing {missing[:5]}, not installed {extra[:5]}"
        )
    return {name: params[param] for name, param in by_name.items()}


def expert_tensors(spec: ModelSpec) -> int:
    """The HF checkpoint's per-expert tensors (gate, up and down of every expert and layer)."""
    return 0 if spec.moe is None else 3 * spec.num_layers * spec.moe.num_experts


def as_loaded(checkpoint: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """An HF checkpoint's tensors as transformers holds them: each layer's per-expert tensors
    stacked into its fused ones (`stack_experts`), the others under
    the model's names."""
    if spec.moe is None:
        return dict(checkpoint)
    names = hf_expert_names(spec.family)
    experts = range(spec.moe.num_experts)
    out: dict[str, torch.Tensor] = {}
    fused: set[str] = set()
    for layer in range(spec.num_layers):
        prefix = f"model.layers.{layer}.{names.experts}"

        def weight(e: int, projection: str, prefix: str = prefix) -> torch.Tensor:
            return checkpoint[f"{prefix}.{e}.{projection}.weight"]

        w13, w2 = stack_experts(weight, names, experts)
        out[_fused_name(layer, FusedExpertTensor.W13)] = w13
        out[_fused_name(layer, FusedExpertTensor.W2)] = w2
        fused |= {
            f"{prefix}.{e}.{p}.weight" for e in experts for p in (names.gate, names.up, names.down)
        }
    for name, tensor in checkpoint.items():
        if name not in fused:
            out[model_name(spec, name)] = tensor
    return out
