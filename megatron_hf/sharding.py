"""Where Megatron parameters live: tensor-parallel partitioning and pipeline stages.

Names are Megatron-core GPTModel parameter names (local or TE spec); a wrapper prefix such as
`module.` is tolerated because matching is by suffix. An expert tensor's placement is over the
expert-tensor-parallel (ETP) ranks of its expert-parallel rank, which holds whole experts
(`megatron_hf.experts`); the router is replicated.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_hf.experts import is_expert_name, parse_expert_suffix


@dataclass(frozen=True, kw_only=True)
class TPPlacement:
    dim: int | None
    """Partition dim across TP ranks; None = replicated on every rank."""
    parts: int = 1
    """>1 when the global tensor is `parts` equal blocks concatenated along `dim`, each block
    split across TP ranks on its own (linear_fc1 = [gate; up]: rank r holds [gate_r; up_r])."""

    def __post_init__(self) -> None:
        if self.parts < 1:
            raise ValueError(f"parts must be >= 1, got {self.parts}")
        if self.dim is None and self.parts != 1:
            raise ValueError("a replicated placement cannot have parts > 1")


REPLICATED = TPPlacement(dim=None)
_ROWS = TPPlacement(dim=0)
_COLS = TPPlacement(dim=1)

# Suffix -> placement. linear_qkv rows are grouped per query group, so contiguous dim-0 chunks
# are whole groups when num_query_groups % tp == 0 (Megatron all-gathers otherwise).
TP_PLACEMENTS: dict[str, TPPlacement] = {
    "embedding.word_embeddings.weight": _ROWS,
    "input_layernorm.weight": REPLICATED,
    "self_attention.linear_qkv.layer_norm_weight": REPLICATED,
    "self_attention.linear_qkv.weight": _ROWS,
    "self_attention.linear_qkv.bias": _ROWS,
    "self_attention.q_layernorm.weight": REPLICATED,
    "self_attention.k_layernorm.weight": REPLICATED,
    "self_attention.linear_proj.weight": _COLS,
    "pre_mlp_layernorm.weight": REPLICATED,
    "mlp.linear_fc1.layer_norm_weight": REPLICATED,
    "mlp.linear_fc1.weight": TPPlacement(dim=0, parts=2),
    "mlp.linear_fc2.weight": _COLS,
    "mlp.router.weight": REPLICATED,
    "decoder.final_layernorm.weight": REPLICATED,
    "output_layer.weight": _ROWS,
}

_LAYER_RE = re.compile(r"^(?P<prefix>(?:.*\.)?decoder\.layers\.)(?P<index>\d+)(?P<rest>\..+)$")


_EXPERT_FC1 = TPPlacement(dim=0, parts=2)


def tp_placement(megatron_name: str) -> TPPlacement:
    """How a parameter splits over its tensor-parallel ranks (ETP ranks for an expert)."""
    if is_expert_name(megatron_name):
        tail = megatron_name[megatron_name.index("mlp.experts.") :]
        param = parse_expert_suffix(tail)
        assert param is not None
        return _EXPERT_FC1 if param.fc == 1 else _COLS
    for suffix, placement in TP_PLACEMENTS.items():
        if megatron_name == suffix or megatron_name.endswith("." + suffix):
            return placement
    if megatron_name.endswith("_extra_state"):
        raise ValueError(f"{megatron_name!r} is TE/Megatron extra state, not a tensor; drop it")
    raise ValueError(
        f"unknown Megatron parameter {megatron_name!r}: no TP placement for it "
        f"(known suffixes: {sorted(TP_PLACEMENTS)})"
    )


def shard(megatron_name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The slice of the global tensor `full` held by TP rank `tp_rank` (contiguous)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
    placement = tp_placement(megatron_name)
    if placement.dim is None or tp_size == 1:
        return full.contiguous()
    dim, parts = placement.dim, placement.parts
    _check_divisible(megatron_name, full, dim, parts * tp_size)
    blocks = full.chunk(parts, dim=dim)
    pieces = [block.chunk(tp_size, dim=dim)[tp_rank] for block in blocks]
    if len(pieces) == 1:
        return pieces[0].contiguous()
    return torch.cat(pieces, dim=dim)


def unshard(megatron_name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of `shard`: the global tensor from all TP ranks' shards, in rank order."""
    if not shards:
        raise ValueError(f"no shards given for {megatron_name!r}")
    placement = tp_placement(megatron_name)
    if placement.dim is None:
        first = shards[0]
        for rank, other in enumerate(shards[1:], start=1):
            if not torch.equal(first, other):
                raise ValueError(
                    f"replicated parameter {megatron_name!r} differs between TP rank 0 "
                    f"and TP rank {rank}"
                )
        return first
    if len(shards) == 1:
        return shards[0]
    dim, parts = placement.dim, placement.parts
    shapes = {tuple(s.shape) for s in shards}
    if len(shapes) != 1:
        raise ValueError(f"shards of {megatron_name!r} have different shapes: {sorted(shapes)}")
    for s in shards:
        _check_divisible(megatron_name, s, dim, parts)
    per_part = [s.chunk(parts, dim=dim) for s in shards]
    blocks = [torch.cat([p[i] for p in per_part], dim=dim) for i in range(parts)]
    return blocks[0] if parts == 1 else torch.cat(blocks, dim=dim)


def _check_divisible(name: str, tensor: torch.Tensor, dim: int, by: int) -> None:
    if tensor.dim() <= dim or tensor.shape[dim] % by:
        raise ValueError(
            f"{name!r} of shape {tuple(tensor.shape)} cannot be split into {by} equal "
            f"blocks along dim {dim}"
        )


def stage_layers(num_layers: int, pipeline_parallel: int, stage: int) -> range:
    """Global layer indices held by pipeline stage `stage` (even split only)."""
    if pipeline_parallel <= 0 or num_layers <= 0:
        raise ValueError(
            f"num_layers and pipeline_parallel must be positive, got "
            f"{num_layers}, {pipeline_parallel}"
        )
    if num_layers % pipeline_parallel:
        raise ValueError(
            f"num_layers ({num_layers}) must be divisible by pipeline_parallel "
            f"({pipeline_parallel}); uneven pipeline splits are not supported"
        )
    if not 0 <= stage < pipeline_parallel:
        raise ValueError(f"stage {stage} out of range for pipeline_parallel {pipeline_parallel}")
    per_stage = num_layers // pipeline_parallel
    return range(stage * per_stage, (stage + 1) * per_stage)


def layer_index(megatron_name: str) -> int | None:
    """The layer index in `decoder.layers.{i}.…`, or None for non-layer names."""
    match = _LAYER_RE.match(megatron_name)
    return int(match["index"]) if match else None


def _shift_layer(name: str, delta: int) -> str:
    match = _LAYER_RE.match(name)
    if match is None:
        return name
    index = int(match["index"]) + delta
    if index < 0:
        raise ValueError(f"layer offset {-delta} exceeds the layer index of {name!r}")
    return f"{match['prefix']}{index}{match['rest']}"


def global_layer_name(local_name: str, layer_offset: int) -> str:
    """Stage-local layer name -> global one (adds the stage's layer offset)."""
    if layer_offset < 0:
        raise ValueError(f"layer_offset must be >= 0, got {layer_offset}")
    return _shift_layer(local_name, layer_offset)


def local_layer_name(global_name: str, layer_offset: int) -> str:
    if layer_offset < 0:
        raise ValueError(f"layer_offset must be >= 0, got {layer_offset}")
    return _shift_layer(global_name, -layer_offset)


def stage_of(megatron_name: str, num_layers: int, pipeline_parallel: int) -> int:
    """Pipeline stage owning a global name: embedding first, final norm and output_layer last.

    With tied embeddings and PP > 1 Megatron also keeps a copy of the embedding as
    `output_layer.weight` on the last stage; that name maps to the last stage.
    """
    index = layer_index(megatron_name)
    if index is not None:
        if index >= num_layers:
            raise ValueError(f"{megatron_name!r}: layer index {index} >= num_layers {num_layers}")
        return index // len(stage_layers(num_layers, pipeline_parallel, 0))
    stage_layers(num_layers, pipeline_parallel, 0)  # validates the split
    if re.match(r"^(?:.*\.)?embedding\.", megatron_name):
        return 0
    if re.match(r"^(?:.*\.)?(?:decoder\.final_layernorm|output_layer)\.", megatron_name):
        return pipeline_parallel - 1
    raise ValueError(f"cannot tell the pipeline stage of {megatron_name!r}")
