"""Moves weights between HF checkpoints and this rank's Megatron shards."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import torch
import torch.distributed as dist

from megatron_hf.convert import local_spec_name, megatron_to_hf
from megatron_hf.sharding import global_layer_name, shard, stage_layers, unshard
from megatron_hf.spec import ModelSpec
from trainer_svc.runtime.topology import Topology

_TIED_OUTPUT = "output_layer.weight"
_EMBEDDING = "embedding.word_embeddings.weight"


def layer_offset(spec: ModelSpec, topology: Topology) -> int:
    return stage_layers(spec.num_layers, topology.layout.pipeline_parallel, topology.pp_rank).start


def local_parameters(
    model: torch.nn.Module, spec: ModelSpec, topology: Topology
) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters by global local-spec Megatron name (TE-spec names mapped, layer
    indices made global)."""
    offset = layer_offset(spec, topology)
    return {
        local_spec_name(global_layer_name(name, offset)): param
        for name, param in model.named_parameters()
    }


@torch.no_grad()
def load_global_state(
    model: torch.nn.Module,
    megatron_state: Mapping[str, torch.Tensor],
    spec: ModelSpec,
    topology: Topology,
) -> None:
    """Copies this rank's TP shard of every global tensor into its parameters."""
    tp = topology.layout.tensor_parallel
    for name, param in local_parameters(model, spec, topology).items():
        source = name
        if name == _TIED_OUTPUT and spec.tie_word_embeddings:
            source = _EMBEDDING
        if source not in megatron_state:
            raise ValueError(f"the checkpoint has no tensor for Megatron parameter {name}")
        piece = shard(name, megatron_state[source], topology.tp_rank, tp)
        if piece.shape != param.shape:
            raise ValueError(
                f"{name}: checkpoint shard {tuple(piece.shape)} != parameter {tuple(param.shape)}"
            )
        param.copy_(piece.to(param.dtype))


def gather_hf_state(
    model: torch.nn.Module, spec: ModelSpec, topology: Topology
) -> dict[str, torch.Tensor] | None:
    """Collective over every rank: the full HF state dict on rank 0 (None elsewhere)."""
    mine: dict[str, torch.Tensor] = {}
    if topology.dp_rank == 0:
        for name, param in local_parameters(model, spec, topology).items():
            if name == _TIED_OUTPUT and spec.tie_word_embeddings:
                continue
            mine[name] = param.detach().to("cpu", copy=True)
    gathered: list[tuple[int, dict[str, torch.Tensor]]] | None = (
        [None] * topology.layout.world_size if topology.is_leader else None  # type: ignore[list-item]
    )
    dist.gather_object((topology.tp_rank, mine), gathered, dst=0, group=topology.control_group)
    if gathered is None:
        return None
    shards: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    for tp_rank, tensors in gathered:
        for name, tensor in tensors.items():
            shards[name][tp_rank] = tensor
    full = {
        name: unshard(name, [by_rank[r] for r in sorted(by_rank)])
        for name, by_rank in shards.items()
    }
    return megatron_to_hf(full, spec)
