"""Moves weights between HF checkpoints and this rank's Megatron shards."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_hf.convert import local_spec_name
from megatron_hf.experts import globalize_expert_name, is_expert_name
from megatron_hf.safetensors_file import CheckpointFiles
from megatron_hf.shard_reader import check_checkpoint, padding_rows, read_shard
from megatron_hf.sharding import global_layer_name, stage_layers
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
    and expert indices made global)."""
    offset = layer_offset(spec, topology)
    return {
        _global_name(local_spec_name(global_layer_name(name, offset)), spec, topology): param
        for name, param in model.named_parameters()
    }


def _global_name(name: str, spec: ModelSpec, topology: Topology) -> str:
    if spec.moe is None:
        return name
    return globalize_expert_name(
        name,
        ep_rank=topology.ep_rank,
        num_experts=spec.moe.num_experts,
        expert_parallel=topology.layout.expert_parallel,
    )


def split_of(name: str, topology: Topology) -> tuple[int, int]:
    """(rank, size) of the tensor-parallel split a parameter's shard is part of: ETP for an
    expert tensor, TP for the rest."""
    if is_expert_name(name):
        return topology.etp_rank, topology.layout.expert_tensor_parallel
    return topology.tp_rank, topology.layout.tensor_parallel


@dataclass(frozen=True)
class LoadReport:
    """What loading an HF checkpoint cost this rank."""

    bytes_read: int
    """Tensor bytes read from the checkpoint's files."""
    share_bytes: int
    """Bytes of this rank's shards in the checkpoint's dtype, vocabulary padding excluded: what
    it had to read."""


@torch.no_grad()
def load_hf_weights(
    model: torch.nn.Module,
    model_dir: Path,
    spec: ModelSpec,
    topology: Topology,
    padded_vocab: int,
) -> LoadReport:
    """Copies this rank's TP shard of every parameter from the HF checkpoint in `model_dir`,
    reading only those bytes, one parameter at a time: no rank holds the whole checkpoint, and
    at most one converted parameter is in flight."""
    share = 0
    with CheckpointFiles(model_dir) as files:
        check_checkpoint(files, spec)
        for name, param in local_parameters(model, spec, topology).items():
            source = _EMBEDDING if name == _TIED_OUTPUT and spec.tie_word_embeddings else name
            rank, size = split_of(name, topology)
            piece = read_shard(
                files, source, spec, padded_vocab=padded_vocab, tp_rank=rank, tp_size=size
            )
            zeros = padding_rows(source, spec, padded_vocab, rank, size)
            share += (piece.numel() - zeros * piece[0].numel()) * piece.element_size()
            if piece.shape != param.shape:
                raise ValueError(
                    f"{name}: checkpoint shard {tuple(piece.shape)} != parameter "
                    f"{tuple(param.shape)}"
                )
            param.copy_(piece)
            del piece
        return LoadReport(bytes_read=files.bytes_read, share_bytes=share)
