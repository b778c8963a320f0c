"""A trainer's publication of a version without a trainer or NIXL: every (PP stage, TP rank)
lays its Megatron shards out in one aligned numpy arena (as `ShardSource` does), reports a
partial manifest under its own agent, and the parts are merged as the sidecar's GetManifest
merges them (ranks in order, parameters by name) and sent through the wire format."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from megatron_hf.sharding import local_layer_name, shard, stage_layers, stage_of
from megatron_hf.spec import ModelSpec
from refit_sidecar.core.manifest import (
    AgentRecord,
    DType,
    Manifest,
    ParameterRecord,
    ShardLocation,
    ShardRecord,
    merge_manifests,
)
from refit_sidecar.integrity.checksum import checksum
from refit_sidecar.publish.shard_specs import megatron_shard_spec
from refit_sidecar.service.wire import manifest_from_proto, manifest_to_proto

DTYPES = {torch.float32: DType.FLOAT32, torch.bfloat16: DType.BFLOAT16}
ALIGNMENT = 256


@dataclass(frozen=True)
class Published:
    manifest: Manifest
    buffers: dict[str, list[np.ndarray]]
    """Agent -> its arena (what InMemoryTransport reads)."""


def publish(
    meg: Mapping[str, torch.Tensor],
    spec: ModelSpec,
    *,
    tp: int,
    pp: int = 1,
    version: int = 1,
    slot: int = 0,
    last_first: bool = False,
) -> Published:
    """`meg` (a global Megatron state dict) as a trainer of `tp` x `pp` publishes it into
    snapshot slot `slot`: agent ``trainer-rank{R}-slot{slot}`` per rank R = stage * tp + tp rank.
    `last_first`: each arena holds the parameters in the reverse of `meg`'s order, as
    Megatron's parameter buffer does (the last layer's first)."""
    if spec.num_query_groups % tp:
        raise ValueError(f"Megatron cannot split {spec.num_query_groups} KV groups over TP {tp}")
    partials, buffers = [], {}
    for stage in range(pp):
        offset = stage_layers(spec.num_layers, pp, stage).start
        names = [n for n in meg if stage_of(n, spec.num_layers, pp) == stage]
        for tp_rank in range(tp):
            rank = stage * tp + tp_rank
            agent = f"trainer-rank{rank}-slot{slot}"
            # The rank knows its parameters by stage-local name; the spec carries the global one.
            specs = [
                megatron_shard_spec(
                    local_layer_name(name, offset),
                    tuple(meg[name].shape),
                    DTYPES[meg[name].dtype],
                    tp_rank=tp_rank,
                    tp_size=tp,
                    layer_offset=offset,
                )
                for name in names
            ]
            assert [s.parameter for s in specs] == names
            starts, size = [0] * len(specs), 0
            for i in reversed(range(len(specs))) if last_first else range(len(specs)):
                starts[i] = size
                size = -(-(size + specs[i].nbytes) // ALIGNMENT) * ALIGNMENT
            arena = np.zeros(size, np.uint8)
            records = []
            for s, start in zip(specs, starts, strict=True):
                local = shard(s.parameter, meg[s.parameter], tp_rank, tp)
                assert tuple(local.shape) == s.local_shape
                view = arena[start : start + s.nbytes]
                view[:] = local.contiguous().reshape(-1).view(torch.uint8).numpy()
                location = ShardLocation.contiguous(
                    agent=agent,
                    address=arena.ctypes.data + start,
                    shape=s.local_shape,
                    itemsize=s.dtype.itemsize,
                )
                record = ShardRecord(location, s.pieces, checksum(view), rank, tp_rank, stage)
                records.append(ParameterRecord(s.parameter, s.shape, s.dtype, (record,)))
            partials.append(
                Manifest(
                    version, tuple(records), {agent: AgentRecord(agent, b"in-memory", rank=rank)}
                )
            )
            buffers[agent] = [arena]
    merged = merge_manifests(partials)
    ordered = Manifest(
        version, tuple(sorted(merged.parameters, key=lambda p: p.name)), merged.agents
    )
    return Published(manifest_from_proto(manifest_to_proto(ordered)), buffers)
