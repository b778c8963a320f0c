"""How a rank's tensors are cut into shards: `ShardSpec`s, from TP split parameters or from
megatron_hf's TP placements. Torch-free to import; `megatron_shard_spec` imports megatron_hf
(and with it torch) when called."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from refit_sidecar.core.manifest import Box, DType, ShardPiece

if TYPE_CHECKING:
    from megatron_hf.sharding import TPPlacement


@dataclass(frozen=True)
class ShardSpec:
    """A shard before it has a location: what a source must allocate and fill."""

    parameter: str
    shape: tuple[int, ...]
    """Global shape."""
    dtype: DType
    local_shape: tuple[int, ...]
    pieces: tuple[ShardPiece, ...]
    expert_rank: int = 0
    """An expert tensor's EP rank (`ShardRecord.expert_rank`); 0 for other tensors."""
    expert_tensor_rank: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.local_shape) * self.dtype.itemsize


def split_pieces(
    shape: Sequence[int], dim: int | None, parts: int, rank: int, size: int
) -> tuple[tuple[int, ...], tuple[ShardPiece, ...]]:
    """Local shape and pieces of rank `rank` of `size` when `parts` equal blocks along `dim`
    are each split evenly (dim None: a full replica). linear_fc1 (parts=2): rank r holds
    [gate_r; up_r], two pieces, one per block."""
    shape = tuple(shape)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} out of range for size {size}")
    if dim is None or size == 1:
        return shape, (ShardPiece(Box.full(shape), (0,) * len(shape)),)
    if not 0 <= dim < len(shape) or parts < 1 or shape[dim] % (parts * size):
        raise ValueError(f"shape {shape} cannot be split into {parts}x{size} blocks on dim {dim}")
    block = shape[dim] // parts
    per_rank = block // size
    local = (*shape[:dim], per_rank * parts, *shape[dim + 1 :])
    pieces = []
    for p in range(parts):
        start = p * block + rank * per_rank
        ranges = tuple(
            ((start, start + per_rank) if d == dim else (0, n)) for d, n in enumerate(shape)
        )
        local_start = tuple(p * per_rank if d == dim else 0 for d in range(len(shape)))
        pieces.append(ShardPiece(Box(ranges), local_start))
    return local, tuple(pieces)


def placement_spec(
    name: str,
    placement: TPPlacement,
    shape: Sequence[int],
    dtype: DType,
    *,
    tp_rank: int,
    tp_size: int,
) -> ShardSpec:
    """What TP rank `tp_rank` of `tp_size` holds of the global tensor `name` of `shape`."""
    local_shape, pieces = split_pieces(shape, placement.dim, placement.parts, tp_rank, tp_size)
    return ShardSpec(name, tuple(shape), dtype, local_shape, pieces)


def megatron_shard_spec(
    local_name: str,
    shape: Sequence[int],
    dtype: DType,
    *,
    tp_rank: int,
    tp_size: int,
    layer_offset: int = 0,
) -> ShardSpec:
    """Spec of a rank's parameter given its stage-local Megatron name and global shape; the
    spec carries the global name (layer index + the PP stage's `layer_offset`)."""
    from megatron_hf.sharding import global_layer_name, tp_placement

    name = global_layer_name(local_name, layer_offset)
    return placement_spec(name, tp_placement(name), shape, dtype, tp_rank=tp_rank, tp_size=tp_size)


def expert_group_spec(
    name: str,
    shape: Sequence[int],
    dtype: DType,
    *,
    fc: int,
    ep_rank: int,
    ep_size: int,
    etp_rank: int,
    etp_size: int,
) -> ShardSpec:
    """What a rank holds of a layer's grouped experts (`megatron_hf.experts.
    grouped_expert_shape`: fc1 [E, 2I, H], fc2 [E, H, I]): its EP rank's experts, dim 0
    [r*E/EP, (r+1)*E/EP), each cut over ETP as a dense MLP is over TP (fc1's gate and up rows
    each split, fc2's columns)."""
    shape = tuple(shape)
    if len(shape) != 3 or fc not in (1, 2):
        raise ValueError(f"{name}: grouped experts are 3-d fc1 or fc2, got {shape}, fc{fc}")
    experts = shape[0]
    if ep_size < 1 or experts % ep_size or not 0 <= ep_rank < ep_size:
        raise ValueError(f"{name}: {experts} experts do not split over EP rank {ep_rank}/{ep_size}")
    per_rank = experts // ep_size
    first = ep_rank * per_rank
    dim, parts = (0, 2) if fc == 1 else (1, 1)
    local, pieces = split_pieces(shape[1:], dim, parts, etp_rank, etp_size)
    return ShardSpec(
        name,
        shape,
        dtype,
        (per_rank, *local),
        tuple(
            ShardPiece(Box(((first, first + per_rank), *p.box.ranges)), (0, *p.local_start))
            for p in pieces
        ),
        expert_rank=ep_rank,
        expert_tensor_rank=etp_rank,
    )
