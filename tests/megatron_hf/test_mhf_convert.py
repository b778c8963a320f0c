"""HF -> Megatron -> HF round trips on tiny checkpoints of every supported layout."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from megatron_hf.checkpoint import load_hf_state_dict
from megatron_hf.convert import (
    hf_names,
    hf_to_megatron,
    megatron_names,
    megatron_param_to_hf,
    megatron_to_hf,
)
from megatron_hf.spec import ModelSpec, padded_vocab_size

Loader = Callable[[str], Path]


def _load(tiny_checkpoint: Loader, name: str) -> tuple[dict[str, torch.Tensor], ModelSpec]:
    path = tiny_checkpoint(name)
    return load_hf_state_dict(path), ModelSpec.from_pretrained_dir(path)


@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_is_bit_exact(tiny_checkpoint: Loader, variant: str, tp: int) -> None:
    hf, spec = _load(tiny_checkpoint, variant)
    padded = padded_vocab_size(spec.vocab_size, tp)
    meg = hf_to_megatron(hf, spec, padded)

    assert list(meg) == megatron_names(spec)
    assert ("output_layer.weight" in meg) is (not spec.tie_word_embeddings)
    emb = meg["embedding.word_embeddings.weight"]
    assert emb.shape == (padded, spec.hidden_size)
    assert torch.count_nonzero(emb[spec.vocab_size :]) == 0  # padded rows are zeros
    assert meg["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (
        spec.qkv_rows,
        spec.hidden_size,
    )
    assert meg["decoder.layers.1.mlp.linear_fc1.weight"].shape == (
        2 * spec.ffn_hidden_size,
        spec.hidden_size,
    )

    back = megatron_to_hf(meg, spec)
    assert set(back) == set(hf)  # lm_head absent exactly when tied; padding trimmed
    assert list(back) == hf_names(spec)
    for name, tensor in hf.items():
        assert back[name].dtype == tensor.dtype, name
        assert torch.equal(back[name], tensor), name


def test_variant_specific_parameters_are_carried(tiny_checkpoint: Loader) -> None:
    hf, spec = _load(tiny_checkpoint, "qwen2")
    meg = hf_to_megatron(hf, spec, 128)
    bias = meg["decoder.layers.1.self_attention.linear_qkv.bias"]
    assert bias.shape == (spec.qkv_rows,) and torch.count_nonzero(bias) == spec.qkv_rows
    # the first head_dim rows of the fused bias are query head 0
    assert torch.equal(bias[: spec.head_dim], hf["model.layers.1.self_attn.q_proj.bias"][:16])

    hf, spec = _load(tiny_checkpoint, "qwen3")
    meg = hf_to_megatron(hf, spec, 128)
    q_norm = meg["decoder.layers.0.self_attention.q_layernorm.weight"]
    assert q_norm.shape == (24,)
    assert torch.equal(q_norm, hf["model.layers.0.self_attn.q_norm.weight"])
    assert torch.equal(
        meg["decoder.layers.0.self_attention.k_layernorm.weight"],
        hf["model.layers.0.self_attn.k_norm.weight"],
    )
    assert not torch.equal(q_norm, torch.ones(24))


def test_te_names_and_extra_state_are_accepted(tiny_checkpoint: Loader) -> None:
    hf, spec = _load(tiny_checkpoint, "llama")
    meg = hf_to_megatron(hf, spec, 128)
    te: dict[str, torch.Tensor] = {}
    for name, tensor in meg.items():
        te_name = name.replace(
            "input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"
        ).replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
        te[te_name] = tensor
    te["decoder.layers.0.self_attention.linear_qkv._extra_state"] = torch.empty(0)
    te["output_layer._extra_state"] = torch.empty(0)
    back = megatron_to_hf(te, spec)
    assert set(back) == set(hf)
    assert all(torch.equal(back[n], hf[n]) for n in hf)


def test_duplicate_local_and_te_names_are_rejected(tiny_checkpoint: Loader) -> None:
    hf, spec = _load(tiny_checkpoint, "llama")
    meg = hf_to_megatron(hf, spec, 128)
    meg["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"] = meg[
        "decoder.layers.0.pre_mlp_layernorm.weight"
    ]
    with pytest.raises(ValueError, match="given twice"):
        megatron_to_hf(meg, spec)


def test_tied_output_layer_copy_is_ignored(tiny_checkpoint: Loader) -> None:
    """Under PP>1 Megatron keeps a copy of tied embeddings as output_layer.weight."""
    hf, spec = _load(tiny_checkpoint, "llama_tied")
    meg = hf_to_megatron(hf, spec, 128)
    meg["output_layer.weight"] = meg["embedding.word_embeddings.weight"].clone()
    assert "lm_head.weight" not in megatron_to_hf(meg, spec)
    # HF's in-memory state_dict() lists the tied lm_head too; it is not an error
    hf_with_head = {**hf, "lm_head.weight": hf["model.embed_tokens.weight"]}
    assert "output_layer.weight" not in hf_to_megatron(hf_with_head, spec, 128)


def test_missing_unexpected_and_misshapen_inputs_fail_closed(tiny_checkpoint: Loader) -> None:
    hf, spec = _load(tiny_checkpoint, "llama")
    partial = {k: v for k, v in hf.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing 1 .*model\.layers\.1\.mlp\.up_proj\.weight"):
        hf_to_megatron(partial, spec, 128)
    with pytest.raises(ValueError, match="unexpected 1"):
        hf_to_megatron({**hf, "model.layers.2.mlp.up_proj.weight": torch.zeros(1)}, spec, 128)
    bad = {**hf, "model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}
    with pytest.raises(
        ValueError, match=r"k_proj.weight has shape \(16, 64\), expected \(32, 64\)"
    ):
        hf_to_megatron(bad, spec, 128)
    with pytest.raises(ValueError, match="padded_vocab 100 < vocab_size 101"):
        hf_to_megatron(hf, spec, 100)

    meg = hf_to_megatron(hf, spec, 128)
    del meg["decoder.final_layernorm.weight"]
    with pytest.raises(ValueError, match="missing 1"):
        megatron_to_hf(meg, spec)


def test_rotary_inv_freq_buffers_are_ignored(tiny_checkpoint: Loader) -> None:
    hf, spec = _load(tiny_checkpoint, "llama")
    old_style = {**hf, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    assert set(hf_to_megatron(old_style, spec, 128)) == set(megatron_names(spec))


def test_megatron_param_to_hf_per_parameter(tiny_checkpoint: Loader) -> None:
    hf, spec = _load(tiny_checkpoint, "qwen2")
    meg = hf_to_megatron(hf, spec, 256)
    out = megatron_param_to_hf(
        "decoder.layers.1.mlp.linear_fc1.weight",
        meg["decoder.layers.1.mlp.linear_fc1.weight"],
        spec,
    )
    assert list(out) == ["model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(
        out["model.layers.1.mlp.up_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    )
    emb = megatron_param_to_hf(
        "embedding.word_embeddings.weight", meg["embedding.word_embeddings.weight"], spec
    )
    assert emb["model.embed_tokens.weight"].shape == (101, 64)
    with pytest.raises(ValueError, match="no HF counterpart"):
        megatron_param_to_hf("decoder.layers.0.mlp.router.weight", torch.zeros(1), spec)
    with pytest.raises(ValueError, match="expected"):
        megatron_param_to_hf(
            "decoder.layers.0.self_attention.linear_proj.weight", torch.zeros(64, 63), spec
        )


def test_megatron_names_follow_gpt_model_parameter_order(tiny_checkpoint: Loader) -> None:
    """Order and names as printed by GPTModel.named_parameters() (megatron-core 0.16.1)."""
    spec = ModelSpec.from_pretrained_dir(tiny_checkpoint("qwen2"))
    names = megatron_names(spec)
    assert names[:10] == [
        "embedding.word_embeddings.weight",
        "decoder.layers.0.input_layernorm.weight",
        "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.self_attention.linear_qkv.bias",
        "decoder.layers.0.pre_mlp_layernorm.weight",
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.0.mlp.linear_fc2.weight",
        "decoder.layers.1.input_layernorm.weight",
        "decoder.layers.1.self_attention.linear_proj.weight",
    ]
    assert names[-2:] == ["decoder.final_layernorm.weight", "output_layer.weight"]
    assert len(names) == 1 + 2 * 7 + 2


def test_local_spec_name_maps_te_layer_norm_names_only():
    from megatron_hf.convert import local_spec_name

    assert (
        local_spec_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight")
        == "decoder.layers.3.input_layernorm.weight"
    )
    assert (
        local_spec_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight")
        == "decoder.layers.0.pre_mlp_layernorm.weight"
    )
    for unchanged in (
        "decoder.layers.1.self_attention.linear_qkv.weight",
        "embedding.word_embeddings.weight",
        "decoder.final_layernorm.weight",
    ):
        assert local_spec_name(unchanged) == unchanged
