"""Megatron-core <-> Hugging Face translation for Llama, Qwen2 and Qwen3 causal LMs.

`spec` reads model shapes from an HF config (`rope` its RoPE scaling, computed as transformers
computes it); `convert` maps global (unsharded) state dicts both ways with a name table and named
fused-tensor helpers (`fused`); `sharding` says which TP rank and PP stage holds which part of a
Megatron parameter; `checkpoint` reads and writes HF safetensors checkpoints; `tiny` builds small
seeded checkpoints locally. Nothing here imports megatron, vllm or the trainer, so the trainer
and the vLLM receiver share it.
"""

from importlib import import_module
from typing import Any

# Names are loaded on first use (PEP 562): `tiny` pulls in transformers' model classes, seconds of
# CPU that every trainer rank, engine worker and receiver would pay at `import megatron_hf.spec`.
_EXPORTS = {
    "load_hf_state_dict": "checkpoint",
    "save_hf_checkpoint": "checkpoint",
    "hf_names": "convert",
    "hf_to_megatron": "convert",
    "megatron_names": "convert",
    "megatron_param_to_hf": "convert",
    "megatron_to_hf": "convert",
    "fuse_gate_up": "fused",
    "fuse_qkv": "fused",
    "split_gate_up": "fused",
    "split_qkv": "fused",
    "TPPlacement": "sharding",
    "global_layer_name": "sharding",
    "local_layer_name": "sharding",
    "shard": "sharding",
    "stage_layers": "sharding",
    "stage_of": "sharding",
    "tp_placement": "sharding",
    "unshard": "sharding",
    "ModelFamily": "spec",
    "ModelSpec": "spec",
    "padded_vocab_size": "spec",
    "write_tiny_checkpoint": "tiny",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "ModelFamily",
    "ModelSpec",
    "TPPlacement",
    "fuse_gate_up",
    "fuse_qkv",
    "global_layer_name",
    "hf_names",
    "hf_to_megatron",
    "load_hf_state_dict",
    "local_layer_name",
    "megatron_names",
    "megatron_param_to_hf",
    "megatron_to_hf",
    "padded_vocab_size",
    "save_hf_checkpoint",
    "shard",
    "split_gate_up",
    "split_qkv",
    "stage_layers",
    "stage_of",
    "tp_placement",
    "unshard",
    "write_tiny_checkpoint",
]
