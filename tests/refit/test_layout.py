"""Shard specs from megatron_hf's TP placements match megatron_hf.sharding.shard bit for bit;
a receiver of one PP stage pulls only that stage's parameters."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_hf.sharding import TP_PLACEMENTS, shard, stage_of
from refit_sidecar.core.manifest import (
    DType,
)
from refit_sidecar.core.plan import plan_pull, whole
from refit_sidecar.memory.region import Region
from refit_sidecar.publish.shard_specs import ShardSpec, megatron_shard_spec
from refit_sidecar.pull.transport import InMemoryTransport
from tests.refit.shards import in_memory_manifest, index, random_global, shard_of


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_specs_cut_the_same_shards_as_megatron_hf(tp: int) -> None:
    for suffix, placement in TP_PLACEMENTS.items():
        top_level = suffix.startswith(("embedding.", "decoder.", "output_layer."))
        name = suffix if top_level else f"decoder.layers.3.{suffix}"
        shape = [6, 5] if placement.dim is not None else [7]
        if placement.dim is not None:
            shape[placement.dim] = placement.parts * tp * 3
        full = random_global(name, shape, DType.FLOAT32, tp)
        full_tensor = torch.from_numpy(full.view(np.float32)[..., 0].copy())
        for rank in range(tp):
            spec = megatron_shard_spec(name, shape, DType.FLOAT32, tp_rank=rank, tp_size=tp)
            expected = shard(name, full_tensor, rank, tp).numpy()
            assert spec.local_shape == expected.shape, name
            assert shard_of(full, spec).tobytes() == expected.tobytes(), name


def test_receiver_of_one_pipeline_stage_pulls_only_its_layers() -> None:
    pp, tp, num_layers = 2, 2, 4
    local_names = {
        "embedding.word_embeddings.weight": (16, 4),
        "decoder.layers.0.mlp.linear_fc1.weight": (8, 4),
        "decoder.layers.1.self_attention.linear_proj.weight": (4, 4),
        "decoder.final_layernorm.weight": (4,),
    }
    placed: list[tuple[str, ShardSpec, np.ndarray]] = []
    fulls: dict[str, np.ndarray] = {}
    for stage in range(pp):
        for rank in range(tp):
            for local, shape in local_names.items():
                first = local.startswith("embedding")
                last = local.startswith("decoder.final")
                if (first and stage != 0) or (last and stage != pp - 1):
                    continue
                spec = megatron_shard_spec(
                    local, shape, DType.BFLOAT16, tp_rank=rank, tp_size=tp, layer_offset=stage * 2
                )
                full = fulls.setdefault(
                    spec.parameter, random_global(spec.parameter, shape, DType.BFLOAT16, 0)
                )
                placed.append((f"pp{stage}-tp{rank}", spec, shard_of(full, spec)))
    manifest = in_memory_manifest(7, placed)
    assert "decoder.layers.3.self_attention.linear_proj.weight" in manifest.names
    mine = [n for n in manifest.names if stage_of(n, num_layers, pp) == 1]
    assert sorted(mine) == [
        "decoder.final_layernorm.weight",
        "decoder.layers.2.mlp.linear_fc1.weight",
        "decoder.layers.3.self_attention.linear_proj.weight",
    ]
    plan = plan_pull(manifest, whole(manifest, mine))
    assert {r.location.agent for r in plan.reads} == {"pp1-tp0", "pp1-tp1"}
    dest = np.zeros(plan.nbytes, np.uint8)
    buffers: dict[str, list[np.ndarray]] = {}
    for agent, _, buffer in placed:
        buffers.setdefault(agent, []).append(buffer)
    InMemoryTransport(buffers).pull(plan, Region.of_array(dest), verify=True)
    for target in plan.targets:
        expected = fulls[target.name][index(target.box)].reshape(-1)
        assert np.array_equal(dest[target.span], expected)
