"""Expert names and layouts, Megatron <-> HF, against a Qwen3-MoE checkpoint transformers
wrote: both directions bit for bit, the router as `mlp.gate`, each expert's gate and up fused
as fc1 and split per ETP rank like dense fc1, local expert ids made global per EP rank, the
grouped (Transformer Engine) names read as the local ones, configs refused that the trainer
cannot build."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_hf.checkpoint import load_hf_state_dict
from megatron_hf.convert import (
    hf_names_of,
    hf_to_megatron,
    local_spec_name,
    megatron_names,
    megatron_to_hf,
)
from megatron_hf.experts import expert_owner, global_expert, globalize_expert_name
from megatron_hf.export_plan import plan_export
from megatron_hf.sharding import shard, tp_placement, unshard
from megatron_hf.spec import ModelFamily, ModelSpec, MoESpec
from megatron_hf.splits import trainer_layout_problems
from megatron_hf.tiny import write_tiny_checkpoint

LAYER = "decoder.layers.1."


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("moe"), ModelFamily.QWEN3_MOE, num_layers=2, seed=3
    )


def test_spec_reads_the_experts(checkpoint):
    spec = ModelSpec.from_pretrained_dir(checkpoint)
    assert spec.moe == MoESpec(num_experts=8, top_k=2, ffn_hidden_size=32, norm_topk_prob=True)
    assert spec.qk_layernorm and spec.architecture == "Qwen3MoeForCausalLM"
    again = ModelSpec.from_hf_config(spec.to_hf_config())
    assert again.moe == spec.moe


def test_round_trip_is_bit_exact_and_lays_experts_out_as_megatron(checkpoint):
    hf = load_hf_state_dict(checkpoint)
    spec = ModelSpec.from_pretrained_dir(checkpoint)
    meg = hf_to_megatron(hf, spec, 128)
    assert list(meg) == megatron_names(spec)
    assert torch.equal(meg[LAYER + "mlp.router.weight"], hf["model.layers.1.mlp.gate.weight"])
    fc1 = meg[LAYER + "mlp.experts.local_experts.5.linear_fc1.weight"]
    gate, up = (hf[f"model.layers.1.mlp.experts.5.{p}_proj.weight"] for p in ("gate", "up"))
    assert torch.equal(fc1, torch.cat([gate, up]))  # [gate; up], as dense fc1
    fc2 = meg[LAYER + "mlp.experts.local_experts.5.linear_fc2.weight"]
    assert torch.equal(fc2, hf["model.layers.1.mlp.experts.5.down_proj.weight"])
    back = megatron_to_hf(meg, spec)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize("etp", [2, 4])
def test_an_expert_splits_over_etp_ranks_as_dense_fc1_over_tp(checkpoint, etp):
    spec = ModelSpec.from_pretrained_dir(checkpoint)
    meg = hf_to_megatron(load_hf_state_dict(checkpoint), spec, 128)
    name = LAYER + "mlp.experts.local_experts.2.linear_fc1.weight"
    pieces = [shard(name, meg[name], rank, etp) for rank in range(etp)]
    rows = 32 // etp
    gate, up = meg[name][:32], meg[name][32:]
    assert torch.equal(pieces[1], torch.cat([gate[rows : 2 * rows], up[rows : 2 * rows]]))
    assert torch.equal(unshard(name, pieces), meg[name])
    assert tp_placement(LAYER + "mlp.router.weight").dim is None


def test_local_expert_ids_become_global_per_ep_rank():
    assert [global_expert(e, ep_rank=1, num_experts=8, expert_parallel=2) for e in range(4)] == [
        4,
        5,
        6,
        7,
    ]
    assert expert_owner(6, num_experts=8, expert_parallel=4) == (3, 0)
    local = LAYER + "mlp.experts.local_experts.1.linear_fc2.weight"
    assert globalize_expert_name(local, ep_rank=3, num_experts=8, expert_parallel=4) == (
        LAYER + "mlp.experts.local_experts.7.linear_fc2.weight"
    )
    with pytest.raises(ValueError, match="8 experts do not split over expert parallel 3"):
        global_expert(0, ep_rank=0, num_experts=8, expert_parallel=3)


def test_grouped_gemm_names_are_read_as_local_ones():
    grouped = LAYER + "mlp.experts.linear_fc1.weight3"
    assert local_spec_name(grouped) == LAYER + "mlp.experts.local_experts.3.linear_fc1.weight"
    assert hf_names_of(grouped) == (
        "model.layers.1.mlp.experts.3.gate_proj.weight",
        "model.layers.1.mlp.experts.3.up_proj.weight",
    )


def test_the_export_plan_holds_every_expert_tensor(checkpoint):
    spec = ModelSpec.from_pretrained_dir(checkpoint)
    plan = plan_export(spec, pipeline_parallel=2, dtype=torch.bfloat16, max_file_bytes=1 << 16)
    assert set(plan.weight_map()) == set(load_hf_state_dict(checkpoint))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mlp_only_layers": [1]}, "dense layers among the expert layers"),
        ({"decoder_sparse_step": 2}, "dense layers among the expert layers"),
        ({"num_experts_per_tok": 9}, "top_k must lie in [1, num_experts=8]"),
        ({"moe_intermediate_size": None}, "lacks required keys ['moe_intermediate_size']"),
    ],
)
def test_configs_the_trainer_cannot_build_are_refused(checkpoint, change, message):
    config = {**ModelSpec.from_pretrained_dir(checkpoint).to_hf_config(), **change}
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ModelSpec.from_hf_config(config)


def test_layouts_the_experts_cannot_be_split_into_name_the_numbers(checkpoint):
    spec = ModelSpec.from_pretrained_dir(checkpoint)
    assert (
        trainer_layout_problems(
            spec,
            tensor_parallel=1,
            pipeline_parallel=1,
            expert_parallel=8,
            expert_tensor_parallel=1,
        )
        == []
    )
    problems = trainer_layout_problems(
        spec, tensor_parallel=2, pipeline_parallel=1, expert_parallel=3, expert_tensor_parallel=3
    )
    assert problems == [
        "8 experts do not split over expert parallel 3",
        "expert width (moe_intermediate_size) 32 does not split over expert tensor parallel 3",
    ]


def test_mixtral_names_its_experts_w1_w3_w2_and_round_trips(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "mixtral", ModelFamily.MIXTRAL, num_layers=2, seed=4)
    hf = load_hf_state_dict(path)
    spec = ModelSpec.from_pretrained_dir(path)
    assert spec.moe == MoESpec(num_experts=8, top_k=2, ffn_hidden_size=32, norm_topk_prob=True)
    assert not spec.qk_layernorm
    meg = hf_to_megatron(hf, spec, 128)
    prefix = "model.layers.1.block_sparse_moe."
    assert torch.equal(meg[LAYER + "mlp.router.weight"], hf[prefix + "gate.weight"])
    fc1 = meg[LAYER + "mlp.experts.local_experts.3.linear_fc1.weight"]
    w1, w3 = (hf[f"{prefix}experts.3.{w}.weight"] for w in ("w1", "w3"))
    assert torch.equal(fc1, torch.cat([w1, w3]))  # w1 is the gate, w3 the up projection
    back = megatron_to_hf(meg, spec)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[name], tensor) for name, tensor in hf.items())
    with pytest.raises(ValueError, match="sliding_window=4096"):
        ModelSpec.from_hf_config({**spec.to_hf_config(), "sliding_window": 4096})
