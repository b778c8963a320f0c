from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from megatron_hf.spec import ModelFamily, ModelSpec, padded_vocab_size


def _legacy_llama_config(**overrides: Any) -> dict[str, Any]:
    """A transformers-4 style config.json (top-level rope_theta, rope_scaling)."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 101,
        "max_position_embeddings": 256,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    cfg.update(overrides)
    return cfg


def test_from_pretrained_dir_reads_each_family(tiny_checkpoint: Callable[[str], Path]) -> None:
    llama = ModelSpec.from_pretrained_dir(tiny_checkpoint("llama_tied"))
    assert llama.family is ModelFamily.LLAMA
    assert llama.architecture == "LlamaForCausalLM"
    assert (llama.num_layers, llama.hidden_size, llama.ffn_hidden_size) == (2, 64, 128)
    assert (llama.num_attention_heads, llama.num_query_groups, llama.head_dim) == (4, 2, 16)
    assert llama.vocab_size == 101
    assert llama.tie_word_embeddings and not llama.qkv_bias and not llama.qk_layernorm
    assert llama.rope_theta == 10000.0

    qwen2 = ModelSpec.from_pretrained_dir(tiny_checkpoint("qwen2"))
    assert qwen2.family is ModelFamily.QWEN2 and qwen2.qkv_bias and not qwen2.qk_layernorm
    assert qwen2.head_dim == 16

    qwen3 = ModelSpec.from_pretrained_dir(tiny_checkpoint("qwen3"))
    assert qwen3.family is ModelFamily.QWEN3 and qwen3.qk_layernorm and not qwen3.qkv_bias
    assert qwen3.head_dim == 24  # != hidden / heads
    assert qwen3.qkv_rows == 2 * (2 + 2) * 24

    mistral = ModelSpec.from_pretrained_dir(tiny_checkpoint("mistral"))
    assert mistral.family is ModelFamily.MISTRAL
    assert mistral.architecture == "MistralForCausalLM"
    assert not mistral.qkv_bias and not mistral.qk_layernorm and mistral.head_dim == 24


def test_from_hf_config_accepts_pretrained_config_and_legacy_dict(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    path = tiny_checkpoint("qwen3")
    assert ModelSpec.from_hf_config(AutoConfig.from_pretrained(path)) == (
        ModelSpec.from_pretrained_dir(path)
    )
    legacy = ModelSpec.from_hf_config(_legacy_llama_config())
    assert legacy.rope_theta == 500000.0
    assert legacy.rms_norm_eps == 1e-5
    assert legacy.head_dim == 16


def test_to_hf_config_round_trips(tiny_checkpoint: Callable[[str], Path]) -> None:
    for name in ("llama_tied", "qwen2", "qwen3", "mistral"):
        spec = ModelSpec.from_pretrained_dir(tiny_checkpoint(name))
        assert ModelSpec.from_hf_config(spec.to_hf_config()) == spec


def test_a_mistral_config_written_from_a_spec_means_full_attention_to_transformers(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """MistralConfig reads an absent sliding_window as 4096 tokens: the config a spec writes
    must say null, or an exported model would attend through a window the trainer never had."""
    spec = ModelSpec.from_pretrained_dir(tiny_checkpoint("mistral"))
    (tmp_path / "config.json").write_text(json.dumps(spec.to_hf_config()))
    assert AutoConfig.from_pretrained(tmp_path).sliding_window is None


def _mistral_config(**overrides: Any) -> dict[str, Any]:
    cfg = _legacy_llama_config(
        model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None
    )
    cfg.update(overrides)
    return cfg


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (_mistral_config(sliding_window=4096), r"sliding_window=4096 for mistral"),
        (
            {k: v for k, v in _mistral_config().items() if k != "sliding_window"},
            r"sliding_window=4096 for mistral \(absent means 4096\)",
        ),
        (_mistral_config(llama_4_scaling={"beta": 0.1}), r"llama_4_scaling=.* for mistral"),
        (_mistral_config(architectures=["LlamaForCausalLM"]), "expected 'MistralForCausalLM'"),
    ],
)
def test_a_mistral_config_is_refused_unless_it_is_llama_under_another_name(
    cfg: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_hf_config(cfg)


def test_rejects_unsupported_model_type_naming_supported_ones() -> None:
    with pytest.raises(
        ValueError, match=r"unsupported model_type 'gemma'.*llama, qwen2, qwen3, mistral"
    ):
        ModelSpec.from_hf_config(_legacy_llama_config(model_type="gemma"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"architectures": ["LlamaForSequenceClassification"]}, "expected 'LlamaForCausalLM'"),
        ({"num_key_value_heads": 3}, "divisible by num_query_groups"),
    ],
)
def test_rejects_unsupported_features(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_hf_config(_legacy_llama_config(**overrides))


def test_rejects_config_missing_required_keys() -> None:
    cfg = _legacy_llama_config()
    del cfg["intermediate_size"]
    with pytest.raises(ValueError, match=r"lacks required keys \['intermediate_size'\]"):
        ModelSpec.from_hf_config(cfg)


def test_default_rope_parameters_are_accepted() -> None:
    cfg = _legacy_llama_config(rope_scaling=None, rope_theta=None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    assert ModelSpec.from_hf_config(cfg).rope_theta == 1e6


def test_post_init_validates_fields() -> None:
    spec = ModelSpec.from_hf_config(_legacy_llama_config())
    with pytest.raises(ValueError, match="num_layers must be positive"):
        dataclasses.replace(spec, num_layers=0)
    with pytest.raises(ValueError, match="does not match family"):
        dataclasses.replace(spec, family=ModelFamily.QWEN2)


@pytest.mark.parametrize(
    ("pad_token_id", "row"),
    [(None, None), (0, 0), (100, 100), (-1, 100), (101, None), (-102, None)],
)
def test_pad_token_id_names_the_row_hf_freezes(pad_token_id: int | None, row: int | None) -> None:
    """As nn.Embedding(101, h, padding_idx=pad_token_id) counts it; an id it refuses (HF then
    cannot build the model) freezes nothing."""
    spec = ModelSpec.from_hf_config(_legacy_llama_config(pad_token_id=pad_token_id))
    assert spec.pad_token_id == row
    if row is not None:
        assert torch.nn.Embedding(101, 4, padding_idx=pad_token_id).padding_idx == row
        assert ModelSpec.from_hf_config(spec.to_hf_config()) == spec
    with pytest.raises(ValueError, match="pad_token_id must lie in"):
        dataclasses.replace(spec, pad_token_id=101)


def test_from_pretrained_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no config\.json"):
        ModelSpec.from_pretrained_dir(tmp_path)


@pytest.mark.parametrize(
    ("vocab", "tp", "multiple", "expected"),
    [
        (101, 1, 128, 128),
        (101, 2, 128, 256),
        (128, 1, 128, 128),
        (129, 1, 128, 256),
        (151936, 4, 128, 152064),
        (32000, 8, 128, 32768),
        (7, 3, 1, 9),
    ],
)
def test_padded_vocab_size(vocab: int, tp: int, multiple: int, expected: int) -> None:
    assert padded_vocab_size(vocab, tp, multiple) == expected


def test_padded_vocab_size_rejects_non_positive() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        padded_vocab_size(100, 0)
