"""Tiny transformers models shared by the receiver tests (written and loaded once per session).

The variants cover every layout difference the receiver's translation handles: grouped KV
heads, a single (MQA) KV head, Qwen2's q/k/v bias, Qwen3's q/k norms with head_dim !=
hidden/heads, and tied embeddings (the vocabulary, 101 rows, is padded on both sides).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from megatron_hf.spec import ModelFamily, ModelSpec
from megatron_hf.tiny import write_tiny_checkpoint

VARIANTS: dict[str, dict[str, Any]] = {
    "llama_gqa": {"family": ModelFamily.LLAMA, "num_key_value_heads": 2},
    "llama_mqa_tied": {
        "family": ModelFamily.LLAMA,
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
    },
    "qwen2_tied": {"family": ModelFamily.QWEN2, "tie_word_embeddings": True},
    "qwen3": {"family": ModelFamily.QWEN3, "head_dim": 24},
}


@dataclass(frozen=True)
class Tiny:
    name: str
    path: Path
    spec: ModelSpec
    model: PreTrainedModel
    """The transformers model as loaded from `path` (eval mode)."""
    hf: dict[str, torch.Tensor]
    """Its own state_dict (a tied `lm_head.weight` included), detached."""


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Tiny]:
    """name -> that variant's checkpoint and model, built at most once."""
    built: dict[str, Tiny] = {}

    def get(name: str) -> Tiny:
        if name not in built:
            kwargs = dict(VARIANTS[name])
            family = kwargs.pop("family")
            path = write_tiny_checkpoint(tmp_path_factory.mktemp(name), family, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            hf = {k: v.detach() for k, v in model.state_dict().items()}
            built[name] = Tiny(name, path, ModelSpec.from_pretrained_dir(path), model, hf)
        return built[name]

    return get


@pytest.fixture(params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest) -> str:
    return str(request.param)
