from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from megatron_hf.checkpoint import load_hf_state_dict, save_hf_checkpoint
from megatron_hf.convert import hf_to_megatron, megatron_to_hf
from megatron_hf.spec import ModelSpec

Loader = Callable[[str], Path]
TOKENS = torch.tensor([[1, 23, 24, 17, 25, 26]])


def _logits(path: Path) -> torch.Tensor:
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(path).eval()(TOKENS).logits


def test_export_from_megatron_loads_in_transformers(
    tiny_checkpoint: Loader, tmp_path: Path
) -> None:
    """megatron_to_hf output (views into fused tensors) saves and reloads to identical logits."""
    src = tiny_checkpoint("qwen2")
    spec = ModelSpec.from_pretrained_dir(src)
    hf = megatron_to_hf(hf_to_megatron(load_hf_state_dict(src), spec, 256), spec)
    out = save_hf_checkpoint(tmp_path / "export", hf, src)

    assert out == tmp_path / "export"
    assert {p.name for p in out.iterdir()} >= {
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    reloaded = load_hf_state_dict(out)
    assert set(reloaded) == set(hf)
    assert all(torch.equal(reloaded[k], hf[k]) for k in hf)
    assert torch.equal(_logits(out), _logits(src))
    assert AutoTokenizer.from_pretrained(out).decode([23, 24]) == "12"


@pytest.mark.parametrize("source_kind", ["spec", "pretrained_config", "dict"])
def test_config_sources(tiny_checkpoint: Loader, tmp_path: Path, source_kind: str) -> None:
    src = tiny_checkpoint("llama_tied")
    spec = ModelSpec.from_pretrained_dir(src)
    source: object = {
        "spec": spec,
        "pretrained_config": AutoConfig.from_pretrained(src),
        "dict": json.loads((src / "config.json").read_text()),
    }[source_kind]
    hf = load_hf_state_dict(src)
    # HF's in-memory state dict lists the tied lm_head; it must not be written
    hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    out = save_hf_checkpoint(tmp_path, hf, source)
    assert ModelSpec.from_pretrained_dir(out) == spec
    assert "lm_head.weight" not in load_hf_state_dict(out)
    assert torch.equal(_logits(out), _logits(src))


def test_save_rejects_incomplete_state_and_stale_shards(
    tiny_checkpoint: Loader, tmp_path: Path
) -> None:
    src = tiny_checkpoint("llama")
    hf = load_hf_state_dict(src)
    partial = {k: v for k, v in hf.items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        save_hf_checkpoint(tmp_path / "a", partial, src)
    with pytest.raises(ValueError, match="expected"):
        save_hf_checkpoint(tmp_path / "b", {**hf, "model.norm.weight": torch.ones(3)}, src)
    stale = tmp_path / "c"
    stale.mkdir()
    save_file({"x": torch.zeros(1)}, str(stale / "model-00001-of-00002.safetensors"))
    with pytest.raises(ValueError, match="already holds other weight files"):
        save_hf_checkpoint(stale, hf, src)
    with pytest.raises(ValueError, match="config source must be"):
        save_hf_checkpoint(tmp_path / "d", hf, 42)


def test_load_sharded_index(tiny_checkpoint: Loader, tmp_path: Path) -> None:
    hf = load_hf_state_dict(tiny_checkpoint("llama"))
    names = sorted(hf)
    halves = {
        "model-00001-of-00002.safetensors": names[:10],
        "model-00002-of-00002.safetensors": names[10:],
    }
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: hf[k] for k in keys}, str(tmp_path / file))
        weight_map.update(dict.fromkeys(keys, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_hf_state_dict(tmp_path)
    assert set(loaded) == set(hf) and all(torch.equal(loaded[k], hf[k]) for k in hf)

    weight_map["ghost.weight"] = "model-00001-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match="disagrees with the shard contents"):
        load_hf_state_dict(tmp_path)


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no \*\.safetensors files"):
        load_hf_state_dict(tmp_path)
    save_file({"a": torch.zeros(1)}, str(tmp_path / "one.safetensors"))
    save_file({"a": torch.ones(1)}, str(tmp_path / "two.safetensors"))
    with pytest.raises(ValueError, match="more than one file"):
        load_hf_state_dict(tmp_path)
