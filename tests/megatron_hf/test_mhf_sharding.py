from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from megatron_hf.checkpoint import load_hf_state_dict
from megatron_hf.convert import hf_to_megatron, megatron_names
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
from megatron_hf.spec import ModelSpec, padded_vocab_size


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_unshard_round_trip_for_every_name(
    tiny_checkpoint: Callable[[str], Path], variant: str, tp: int
) -> None:
    path = tiny_checkpoint(variant)
    spec = ModelSpec.from_pretrained_dir(path)
    meg = hf_to_megatron(load_hf_state_dict(path), spec, padded_vocab_size(spec.vocab_size, tp))
    for name in megatron_names(spec):
        full = meg[name]
        placement = tp_placement(name)
        shards = [shard(name, full, r, tp) for r in range(tp)]
        for s in shards:
            assert s.is_contiguous(), name
            if placement.dim is None:
                assert s.shape == full.shape, name
            else:
                assert s.shape[placement.dim] == full.shape[placement.dim] // tp, name
        assert torch.equal(unshard(name, shards), full), name


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fc1_shard_is_gate_chunk_then_up_chunk(tp: int) -> None:
    gate, up = torch.randn(2, 16, 3)
    fc1 = torch.cat([gate, up])
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    for r in range(tp):
        expected = torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
        assert torch.equal(shard(name, fc1, r, tp), expected)


def test_qkv_shards_hold_whole_query_groups() -> None:
    groups, block, hidden = 4, 6, 3  # block = (heads/groups + 2) * head_dim rows
    qkv = torch.arange(groups * block, dtype=torch.float32)[:, None].expand(-1, hidden)
    name = "decoder.layers.5.self_attention.linear_qkv.weight"
    for r in range(2):
        assert torch.equal(shard(name, qkv, r, 2), qkv[r * 2 * block : (r + 1) * 2 * block])
    assert torch.equal(
        shard("decoder.layers.5.self_attention.linear_qkv.bias", qkv[:, 0], 1, 2),
        qkv[2 * block :, 0],
    )


def test_row_parallel_weights_split_columns() -> None:
    w = torch.arange(24.0).view(2, 12)
    s = shard("decoder.layers.0.self_attention.linear_proj.weight", w, 1, 3)
    assert torch.equal(s, w[:, 4:8]) and s.is_contiguous()
    assert torch.equal(shard("decoder.layers.0.mlp.linear_fc2.weight", w, 0, 2), w[:, :6])


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("embedding.word_embeddings.weight", TPPlacement(dim=0)),
        ("output_layer.weight", TPPlacement(dim=0)),
        ("decoder.final_layernorm.weight", TPPlacement(dim=None)),
        ("decoder.layers.3.input_layernorm.weight", TPPlacement(dim=None)),
        ("decoder.layers.3.pre_mlp_layernorm.weight", TPPlacement(dim=None)),
        ("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight", TPPlacement(dim=None)),
        ("decoder.layers.3.mlp.linear_fc1.layer_norm_weight", TPPlacement(dim=None)),
        ("decoder.layers.3.self_attention.q_layernorm.weight", TPPlacement(dim=None)),
        ("decoder.layers.3.self_attention.k_layernorm.weight", TPPlacement(dim=None)),
        ("decoder.layers.3.self_attention.linear_qkv.weight", TPPlacement(dim=0)),
        ("decoder.layers.3.self_attention.linear_qkv.bias", TPPlacement(dim=0)),
        ("decoder.layers.3.self_attention.linear_proj.weight", TPPlacement(dim=1)),
        ("decoder.layers.3.mlp.linear_fc1.weight", TPPlacement(dim=0, parts=2)),
        ("decoder.layers.3.mlp.linear_fc2.weight", TPPlacement(dim=1)),
        ("module.module.decoder.layers.0.mlp.linear_fc2.weight", TPPlacement(dim=1)),
    ],
)
def test_tp_placement_table(name: str, expected: TPPlacement) -> None:
    assert tp_placement(name) == expected


def test_tp_placement_rejects_unknown_and_extra_state() -> None:
    with pytest.raises(ValueError, match="unknown Megatron parameter"):
        tp_placement("decoder.layers.0.mlp.shared_experts.gate_weight")
    with pytest.raises(ValueError, match="extra state"):
        tp_placement("decoder.layers.0.mlp.linear_fc1._extra_state")


def test_shard_and_unshard_errors() -> None:
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    with pytest.raises(ValueError, match="cannot be split into 4 equal blocks"):
        shard(name, torch.zeros(6, 2), 0, 2)
    with pytest.raises(ValueError, match="out of range"):
        shard(name, torch.zeros(8, 2), 2, 2)
    norm = "decoder.layers.0.input_layernorm.weight"
    with pytest.raises(ValueError, match="differs between TP rank 0 and TP rank 1"):
        unshard(norm, [torch.zeros(4), torch.ones(4)])
    with pytest.raises(ValueError, match="different shapes"):
        unshard(name, [torch.zeros(4, 2), torch.zeros(2, 2)])
    with pytest.raises(ValueError, match="no shards"):
        unshard(name, [])


def test_stage_layers_even_split() -> None:
    assert stage_layers(8, 1, 0) == range(8)
    assert [stage_layers(8, 4, s) for s in range(4)] == [
        range(0, 2),
        range(2, 4),
        range(4, 6),
        range(6, 8),
    ]
    with pytest.raises(ValueError, match="must be divisible by pipeline_parallel"):
        stage_layers(6, 4, 0)
    with pytest.raises(ValueError, match="out of range"):
        stage_layers(8, 4, 4)


def test_layer_name_offsets() -> None:
    assert global_layer_name("decoder.layers.1.mlp.linear_fc1.weight", 2) == (
        "decoder.layers.3.mlp.linear_fc1.weight"
    )
    assert local_layer_name("decoder.layers.3.mlp.linear_fc1.weight", 2) == (
        "decoder.layers.1.mlp.linear_fc1.weight"
    )
    assert global_layer_name("module.decoder.layers.10.input_layernorm.weight", 5) == (
        "module.decoder.layers.15.input_layernorm.weight"
    )
    for other in ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight"):
        assert global_layer_name(other, 4) == other
        assert local_layer_name(other, 4) == other
    with pytest.raises(ValueError, match="exceeds the layer index"):
        local_layer_name("decoder.layers.1.input_layernorm.weight", 2)


def test_stage_of() -> None:
    assert stage_of("embedding.word_embeddings.weight", 8, 4) == 0
    assert stage_of("decoder.final_layernorm.weight", 8, 4) == 3
    assert stage_of("output_layer.weight", 8, 4) == 3
    assert [stage_of(f"decoder.layers.{i}.mlp.linear_fc2.weight", 8, 4) for i in range(8)] == [
        0,
        0,
        1,
        1,
        2,
        2,
        3,
        3,
    ]
    assert stage_of("output_layer.weight", 8, 1) == 0
    with pytest.raises(ValueError, match="layer index 8 >= num_layers 8"):
        stage_of("decoder.layers.8.mlp.linear_fc2.weight", 8, 4)
    with pytest.raises(ValueError, match="cannot tell the pipeline stage"):
        stage_of("rotary_pos_emb.inv_freq", 8, 4)


def test_stage_round_trip_over_all_names(tiny_checkpoint: Callable[[str], Path]) -> None:
    """Every global name lands on one stage, and local<->global naming inverts."""
    spec = ModelSpec.from_pretrained_dir(tiny_checkpoint("llama"))
    pp = 2
    for name in megatron_names(spec):
        stage = stage_of(name, spec.num_layers, pp)
        offset = stage_layers(spec.num_layers, pp, stage).start
        local = local_layer_name(name, offset)
        assert global_layer_name(local, offset) == name
        if "layers." in name:
            assert local.startswith("decoder.layers.0.")
