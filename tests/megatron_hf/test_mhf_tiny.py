from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_hf.checkpoint import load_hf_state_dict
from megatron_hf.spec import ModelFamily
from megatron_hf.tiny import CHARACTERS, SPECIAL_TOKENS, write_tiny_checkpoint

Loader = Callable[[str], Path]


def test_loads_offline_with_auto_classes(tiny_checkpoint: Loader, variant: str) -> None:
    path = tiny_checkpoint(variant)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = json.loads((path / "config.json").read_text())

    assert len(tokenizer) == model.config.vocab_size == config["vocab_size"]
    assert next(model.parameters()).dtype == torch.float32
    assert tokenizer.convert_ids_to_tokens([0, 1, 2, 3]) == ["<pad>", "<s>", "</s>", "<unk>"]
    for key, value in {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}.items():
        assert config[key] == value
        assert getattr(model.generation_config, key) == value
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)

    ids = tokenizer("12+34=46").input_ids
    assert ids == [len(SPECIAL_TOKENS) + CHARACTERS.index(c) for c in "12+34=46"]
    assert tokenizer.decode(ids) == "12+34=46"
    text = "Q: what is 7*6?\nA: 42; (x - y) / z != w."
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, 8, len(tokenizer)) and torch.isfinite(logits).all()


def test_norms_and_biases_are_perturbed(tiny_checkpoint: Loader) -> None:
    qwen2 = load_hf_state_dict(tiny_checkpoint("qwen2"))
    for name in ("q_proj", "k_proj", "v_proj"):
        bias = qwen2[f"model.layers.0.self_attn.{name}.bias"]
        assert torch.count_nonzero(bias) == bias.numel()
    qwen3 = load_hf_state_dict(tiny_checkpoint("qwen3"))
    norms = [n for n in qwen3 if n.endswith("norm.weight")]
    assert len(norms) == 2 * 4 + 1
    for name in norms:
        assert not torch.equal(qwen3[name], torch.ones_like(qwen3[name])), name
    assert not torch.equal(
        qwen3["model.layers.0.self_attn.q_norm.weight"],
        qwen3["model.layers.0.self_attn.k_norm.weight"],
    )


def test_seeded_and_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = load_hf_state_dict(write_tiny_checkpoint(tmp_path / "a", ModelFamily.QWEN3, seed=7))
    assert torch.equal(torch.rand(1), expected_next)
    b = load_hf_state_dict(write_tiny_checkpoint(tmp_path / "b", ModelFamily.QWEN3, seed=7))
    c = load_hf_state_dict(write_tiny_checkpoint(tmp_path / "c", ModelFamily.QWEN3, seed=8))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(
        a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"]
    )


def test_rejects_head_dim_for_qwen2(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Qwen2 has no head_dim"):
        write_tiny_checkpoint(tmp_path, ModelFamily.QWEN2, head_dim=32)
