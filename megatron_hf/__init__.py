"""Megatron-core <-> Hugging Face translation for Llama, Qwen2 and Qwen3 causal LMs.

`spec` reads model shapes from an HF config; `convert` maps global (unsharded) state dicts both
ways with a name table and named fused-tensor helpers (`fused`); `sharding` says which TP rank
and PP stage holds which part of a Megatron parameter; `checkpoint` reads and writes HF
safetensors checkpoints; `tiny` builds small seeded checkpoints locally. Nothing here imports
megatron, vllm or the trainer, so the trainer and the vLLM receiver share it.
"""

from megatron_hf.checkpoint import load_hf_state_dict, save_hf_checkpoint
from megatron_hf.convert import (
    hf_names,
    hf_to_megatron,
    megatron_names,
    megatron_param_to_hf,
    megatron_to_hf,
)
from megatron_hf.fused import fuse_gate_up, fuse_qkv, split_gate_up, split_qkv
from megatron_hf.sharding import (
    TPPlacement,
    global_layer_name,
    local_layer_name,
    shard,
    stage_layers,
    stage_of,
    tp_placement,
    unshard,
)
from megatron_hf.spec import ModelFamily, ModelSpec, padded_vocab_size
from megatron_hf.tiny import write_tiny_checkpoint

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
