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
    writer = FileWriter(
        tmp_path / "x.safetensors",
        torch.bfloat16,
        [(k, tuple(v.shape)) for k, v in tensors.items()],
    )
    assert not (tmp_path / "x.safetensors").exists()  # only once complete
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    writer.close()
    loaded = load_file(tmp_path / "x.safetensors")
    assert list(loaded) == list(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor.to(torch.bfloat16))
    with CheckpointFiles(tmp_path) as files:
        assert torch.equal(files.read("c"), tensors["c"].to(torch.bfloat16))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]


def test_the_writer_refuses_a_tensor_out_of_order_and_leaves_no_file(tmp_path):
    writer = FileWriter(tmp_path / "x.safetensors", torch.float32, [("a", (2,)), ("b", (3,))])
    with pytest.raises(ValueError, match=r"got b \[3\] where its header has a \[2\]"):
        writer.write("b", torch.zeros(3))
    with pytest.raises(ValueError, match="a was never written"):
        writer.close()
    writer.abandon()
    assert list(tmp_path.iterdir()) == []
