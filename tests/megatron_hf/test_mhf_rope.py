"""Scaled RoPE read from HF configs against transformers' own: the same inverse frequencies bit
for bit and the same attention factor for every accepted kind, both config forms, the refusals,
and a config.json written back that transformers and the parser read alike."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, PretrainedConfig, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from megatron_hf.rope import (
    RopeKind,
    RopeScaling,
    attention_factor,
    hf_rope_scaling,
    inverse_frequencies,
)
from megatron_hf.spec import ModelSpec

_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 101,
}

# name -> (config class, config.json fields beyond _SHAPE, in the legacy rope_scaling form)
CASES: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "default": (LlamaConfig, {"rope_theta": 500000.0, "max_position_embeddings": 2048}),
    "llama3-llama3.1": (
        LlamaConfig,
        {
            "rope_theta": 500000.0,
            "head_dim": 128,
            "max_position_embeddings": 131072,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
    "llama3-llama3.2": (
        LlamaConfig,
        {
            "rope_theta": 500000.0,
            "head_dim": 64,
            "max_position_embeddings": 131072,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
    "llama3-other": (
        LlamaConfig,
        {
            "rope_theta": 10000,
            "head_dim": 32,
            "max_position_embeddings": 8192,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 4,
                "low_freq_factor": 2,
                "high_freq_factor": 8,
                "original_max_position_embeddings": 512,
            },
        },
    ),
    "linear": (
        LlamaConfig,
        {
            "rope_theta": 10000.0,
            "max_position_embeddings": 4096,
            "rope_scaling": {"type": "linear", "factor": 2.0},
        },
    ),
    "linear-int": (
        Qwen3Config,
        {
            "rope_theta": 1000000,
            "head_dim": 128,
            "max_position_embeddings": 16384,
            "rope_scaling": {"rope_type": "linear", "factor": 4},
        },
    ),
    "yarn-qwen3": (
        Qwen3Config,
        {
            "rope_theta": 1000000,
            "head_dim": 128,
            "max_position_embeddings": 131072,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
            },
        },
    ),
    "yarn-mscale": (
        LlamaConfig,
        {
            "rope_theta": 10000.0,
            "head_dim": 64,
            "max_position_embeddings": 163840,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 40,
                "original_max_position_embeddings": 4096,
                "mscale": 1.0,
                "mscale_all_dim": 0.707,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        },
    ),
    "yarn-mscale-alone": (
        LlamaConfig,
        {
            "rope_theta": 10000.0,
            "head_dim": 64,
            "max_position_embeddings": 32768,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 4096,
                "mscale": 0.707,
            },
        },
    ),
    "yarn-attention-factor": (
        Qwen3Config,
        {
            "rope_theta": 1000000.0,
            "head_dim": 64,
            "max_position_embeddings": 32768,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 4096,
                "attention_factor": 1.5,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
            },
        },
    ),
    "yarn-untruncated": (
        LlamaConfig,
        {
            "rope_theta": 150000.0,
            "head_dim": 64,
            "max_position_embeddings": 131072,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        },
    ),
    "yarn-null-factor": (
        Qwen3Config,
        {
            "rope_theta": 1000000,
            "head_dim": 128,
            "max_position_embeddings": 65536,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": None,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
    "yarn-tiny": (
        LlamaConfig,
        {
            "rope_theta": 10000.0,
            "head_dim": 16,
            "max_position_embeddings": 256,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
}


def _config_json(name: str) -> dict[str, Any]:
    config_cls, fields = CASES[name]
    model_type = config_cls.model_type
    return copy.deepcopy({"model_type": model_type, **_SHAPE, **fields})


def _transformers_rope(config: PretrainedConfig) -> tuple[torch.Tensor, float]:
    """The inverse frequencies and attention factor transformers' rotary embedding uses."""
    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))


def _ours(spec: ModelSpec) -> tuple[torch.Tensor, float]:
    inv_freq = inverse_frequencies(spec.rope_scaling, spec.head_dim, spec.rope_theta)
    return inv_freq, attention_factor(spec.rope_scaling)


@pytest.mark.parametrize("name", sorted(CASES))
def test_inverse_frequencies_and_attention_factor_equal_transformers(name: str) -> None:
    config_cls = CASES[name][0]
    config = config_cls(**_config_json(name))
    want_freq, want_factor = _transformers_rope(config)
    got_freq, got_factor = _ours(ModelSpec.from_hf_config(_config_json(name)))
    assert got_freq.dtype == want_freq.dtype == torch.float32
    assert torch.equal(got_freq, want_freq)
    assert got_factor == want_factor


@pytest.mark.parametrize("name", sorted(CASES))
def test_both_config_forms_and_the_config_object_parse_alike(name: str) -> None:
    legacy = _config_json(name)
    modern = _config_json(name)
    params = dict(modern.pop("rope_scaling", None) or {"rope_type": "default"})
    params["rope_theta"] = modern.pop("rope_theta")
    modern["rope_parameters"] = params
    config_cls = CASES[name][0]
    spec = ModelSpec.from_hf_config(legacy)
    assert ModelSpec.from_hf_config(modern) == spec
    assert ModelSpec.from_hf_config(config_cls(**_config_json(name))) == spec


@pytest.mark.parametrize("name", sorted(CASES))
def test_to_hf_config_round_trips_through_transformers(name: str, tmp_path: Path) -> None:
    spec = ModelSpec.from_hf_config(_config_json(name))
    written = spec.to_hf_config()
    assert ModelSpec.from_hf_config(written) == spec
    (tmp_path / "config.json").write_text(json.dumps(written))
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert ModelSpec.from_hf_config(loaded) == spec
    want_freq, want_factor = _transformers_rope(loaded)
    got_freq, got_factor = _ours(spec)
    assert torch.equal(got_freq, want_freq) and got_factor == want_factor


def test_transformers_defaults_are_filled_in() -> None:
    qwen3 = hf_rope_scaling(_config_json("yarn-qwen3"))
    assert qwen3 == RopeScaling(
        kind=RopeKind.YARN,
        factor=4.0,
        original_max_position_embeddings=32768,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=True,
    )
    assert attention_factor(qwen3) == 0.1 * math.log(4.0) + 1.0
    assert hf_rope_scaling(_config_json("yarn-null-factor")).factor == 65536 / 8192
    # Without an original length, transformers takes max_position_embeddings for it; a
    # top-level one overrides the dict's.
    cfg = _config_json("llama3-llama3.1")
    del cfg["rope_scaling"]["original_max_position_embeddings"]
    assert hf_rope_scaling(cfg).original_max_position_embeddings == 131072
    cfg["original_max_position_embeddings"] = 4096
    assert hf_rope_scaling(cfg).original_max_position_embeddings == 4096
    assert hf_rope_scaling({"max_position_embeddings": 8}) == RopeScaling()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            "rope_scaling.rope_type 'dynamic'",
        ),
        (
            {
                "rope_parameters": {
                    "rope_type": "longrope",
                    "short_factor": [1.0],
                    "long_factor": [2.0],
                }
            },
            "rope_parameters.rope_type 'longrope'",
        ),
        ({"rope_parameters": {"rope_type": "proportional"}}, "rope_type 'proportional'"),
        ({"rope_scaling": {"type": "su", "factor": 2.0}}, "rope_scaling.rope_type 'su'"),
        ({"rope_scaling": {"rope_type": "ntk-by-parts"}}, "rope_type 'ntk-by-parts'"),
        ({"rope_scaling": {"rope_type": None}}, "rope_type None"),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
            "partial_rotary_factor 0.5",
        ),
        ({"partial_rotary_factor": 0.25}, "partial_rotary_factor 0.25"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}},
            "lacks low_freq_factor",
        ),
        ({"rope_scaling": {"rope_type": "linear"}}, "lacks factor"),
        ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "factor must be a number"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": "no"}},
            "truncate must be a boolean",
        ),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "default"}}},
            "one flat dict",
        ),
    ],
)
def test_refuses_what_it_does_not_compute(fields: dict[str, Any], message: str) -> None:
    cfg = {"model_type": "llama", **_SHAPE, "max_position_embeddings": 4096, **fields}
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_hf_config(cfg)


def test_yarn_without_factor_is_refused_as_transformers_refuses_it() -> None:
    """transformers falls back to max_position_embeddings / original only for `factor: null`;
    a YaRN dict without the key fails its validation, and so it does here."""
    cfg = _config_json("yarn-null-factor")
    del cfg["rope_scaling"]["factor"]
    with pytest.raises(KeyError, match="factor"):
        Qwen3Config(**copy.deepcopy(cfg))
    with pytest.raises(ValueError, match="rope_scaling with rope_type 'yarn' lacks factor"):
        ModelSpec.from_hf_config(cfg)
