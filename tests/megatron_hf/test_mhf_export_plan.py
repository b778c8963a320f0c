"""The export plan puts every HF tensor in exactly one file written by the stage that holds it,
and the file writer produces files the safetensors package reads back exactly."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_hf.convert import hf_names, hf_names_of, megatron_names
from megatron_hf.export_plan import plan_export
from megatron_hf.safetensors_file import CheckpointFiles, FileWriter
from megatron_hf.sharding import stage_of
from megatron_hf.spec import ModelSpec

SPEC = ModelSpec.from_hf_config(
    {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": True,
        "max_position_embeddings": 256,
    }
)


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_every_tensor_lies_in_one_file_of_the_stage_that_holds_it(stages):
    plan = plan_export(SPEC, pipeline_parallel=stages, dtype=torch.bfloat16, max_file_bytes=40_000)
    assert list(plan.weight_map()) == hf_names(SPEC)
    stage_of_hf = {
        h: stage_of(m, SPEC.num_layers, stages)
        for m in megatron_names(SPEC)
        for h in hf_names_of(m)
    }
    assert len(plan.files) >= 3
    for k, file in enumerate(plan.files, start=1):
        assert file.name == f"model-{k:05d}-of-{len(plan.files):05d}.safetensors"
        assert {stage_of_hf[t.name] for t in file.tensors} == {file.stage}
        assert [t.begin for t in file.tensors] == [0, *(t.end for t in file.tensors[:-1])]
        for t in file.tensors:
            assert t.end - t.begin == torch.Size(t.shape).numel() * 2
        # A file is full before the next starts, unless the next tensor is the stage's first.
        assert file.nbytes <= 40_000 or len(file.tensors) == 1
    assert plan.total_bytes == sum(
        torch.Size(t.shape).numel() * 2 for f in plan.files for t in f.tensors
    )
    assert sorted({f.stage for f in plan.files}) == list(range(stages))


def test_a_tensor_larger_than_a_file_gets_a_file_of_its_own():
    plan = plan_export(SPEC, pipeline_parallel=1, dtype=torch.float32, max_file_bytes=1000)
    (embedding,) = [f for f in plan.files if f.tensors[0].name == "model.embed_tokens.weight"]
    assert len(embedding.tensors) == 1 and embedding.nbytes > 1000


def test_the_writer_writes_what_safetensors_reads(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7), "c": torch.randn(2, 2, 2)}
    dtypes = {"a": torch.bfloat16, "b": torch.float32, "c": torch.float16}
    writer = FileWriter(
        tmp_path / "x.safetensors", [(k, tuple(v.shape), dtypes[k]) for k, v in tensors.items()]
    )
    assert not (tmp_path / "x.safetensors").exists()  # only once complete
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    writer.close()
    loaded = load_file(tmp_path / "x.safetensors")
    assert list(loaded) == list(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor.to(dtypes[name]))
    with CheckpointFiles(tmp_path) as files:
        assert torch.equal(files.read("c"), tensors["c"].to(torch.float16))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]


def test_the_writer_refuses_a_tensor_out_of_order_and_leaves_no_file(tmp_path):
    f32 = torch.float32
    writer = FileWriter(tmp_path / "x.safetensors", [("a", (2,), f32), ("b", (3,), f32)])
    with pytest.raises(ValueError, match=r"got b \[3\] where its header has a \[2\]"):
        writer.write("b", torch.zeros(3))
    with pytest.raises(ValueError, match="a was never written"):
        writer.close()
    writer.abandon()
    assert list(tmp_path.iterdir()) == []


def test_each_tensor_may_keep_its_parameters_dtype():
    """The trainer's own dtypes (a bf16 model keeps its norms in float32): an HF tensor takes
    its Megatron parameter's dtype, and the config names the dtype of most bytes."""
    dtypes = {
        name: torch.float32 if name.endswith("layernorm.weight") else torch.bfloat16
        for name in megatron_names(SPEC)
    }
    plan = plan_export(SPEC, pipeline_parallel=2, dtype=dtypes)
    for megatron_name in megatron_names(SPEC):
        for hf_name in hf_names_of(megatron_name):
            (planned,) = [t for f in plan.files for t in f.tensors if t.name == hf_name]
            assert planned.dtype == dtypes[megatron_name], hf_name
            assert planned.end - planned.begin == torch.Size(planned.shape).numel() * (
                4 if planned.dtype == torch.float32 else 2
            )
    assert plan.main_dtype == torch.bfloat16
