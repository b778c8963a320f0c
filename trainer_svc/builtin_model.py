"""The default model: a tiny Llama-family HF checkpoint built locally, so nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

from megatron_hf.spec import ModelFamily
from megatron_hf.tiny import write_tiny_checkpoint


def write_builtin_model(path: Path, *, seed: int) -> Path:
    if (path / "config.json").is_file():
        return path
    return write_tiny_checkpoint(
        path,
        ModelFamily.LLAMA,
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # the smallest head size vLLM's CPU attention supports
        intermediate_size=128,
        seed=seed,
    )
