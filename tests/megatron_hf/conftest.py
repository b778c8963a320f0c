"""Tiny HF checkpoints shared by the megatron_hf tests (written once per session)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from megatron_hf.spec import ModelFamily
from megatron_hf.tiny import write_tiny_checkpoint

# name -> write_tiny_checkpoint arguments; covers every layout difference the converter handles.
VARIANTS: dict[str, dict[str, Any]] = {
    "llama": {"family": ModelFamily.LLAMA},
    "llama_tied": {"family": ModelFamily.LLAMA, "tie_word_embeddings": True},
    "llama_mqa": {"family": ModelFamily.LLAMA, "num_key_value_heads": 1},
    "qwen2": {"family": ModelFamily.QWEN2},
    "qwen3": {"family": ModelFamily.QWEN3, "head_dim": 24},
    "mistral": {"family": ModelFamily.MISTRAL, "head_dim": 24},
}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Returns a function name -> checkpoint dir, writing each variant at most once."""
    written: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in written:
            kwargs = dict(VARIANTS[name])
            family = kwargs.pop("family")
            path = tmp_path_factory.mktemp(f"tiny_{name}")
            written[name] = write_tiny_checkpoint(path, family, **kwargs)
        return written[name]

    return get


@pytest.fixture(params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest) -> str:
    """Each variant name in turn."""
    return str(request.param)
