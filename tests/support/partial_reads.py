"""Two TP=2 workers' halves of a TP=1 trainer's host slot, pulled in memory: the shards each
reads part of (a row-parallel weight's column half, a column-parallel one's row half, a padded
vocabulary's half) and one read whole."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from refit_sidecar.core.manifest import Box, DType, Manifest, ShardPiece
from refit_sidecar.core.plan import PullPlan, ShardOrder, Want, plan_pull
from refit_sidecar.integrity.checksum import host_checksums
from refit_sidecar.integrity.partial_sums import PartialSums
from refit_sidecar.memory.region import Region
from refit_sidecar.publish.shard_specs import ShardSpec
from refit_sidecar.pull.transport import InMemoryTransport, PullStats
from tests.refit.shards import in_memory_manifest

SHAPES = {
    "row_parallel": (64, 96),  # a worker reads a column half: one piece per row
    "column_parallel": (96, 64),  # a row half: one piece
    "vocab": (101, 32),  # rows [0, 50) and [50, 100): the last row (padding) unread
    "norm": (32,),  # read whole by each worker
}


def wants(worker: int) -> list[Want]:
    lo, hi = 48 * worker, 48 * (worker + 1)
    return [
        Want("row_parallel", Box(((0, 64), (lo, hi)))),
        Want("column_parallel", Box(((lo, hi), (0, 64)))),
        Want("vocab", Box(((50 * worker, 50 * (worker + 1)), (0, 32)))),
        Want("norm", Box.full((32,))),
    ]


def source_slot(seed: int = 3) -> tuple[Manifest, dict[str, np.ndarray]]:
    """A TP=1 trainer's host slot: each tensor one shard, with its CRC-32 and WSUM-64."""
    rng = np.random.default_rng(seed)
    placed, buffers = [], {}
    for name, shape in SHAPES.items():
        buffer = np.frombuffer(rng.bytes(int(np.prod(shape)) * 2), np.uint8).copy()
        piece = ShardPiece(Box.full(shape), (0,) * len(shape))
        placed.append(("rank-0", ShardSpec(name, shape, DType.BFLOAT16, shape, (piece,)), buffer))
        buffers[name] = buffer
    manifest = in_memory_manifest(1, placed)
    parameters = tuple(
        replace(p, shards=(replace(p.shards[0], **host_checksums(buffers[p.name])._asdict()),))
        for p in manifest.parameters
    )
    return replace(manifest, parameters=parameters), buffers


def pull_half(
    manifest: Manifest, buffers: dict[str, np.ndarray], worker: int
) -> tuple[PullPlan, torch.Tensor, Region, PullStats]:
    """Worker `worker`'s wants pulled and verified into host staging."""
    plan = plan_pull(manifest, wants(worker))
    staging = torch.zeros(plan.nbytes, dtype=torch.uint8)
    region = Region(staging.data_ptr(), staging.numel(), owner=staging)
    stats = InMemoryTransport({"rank-0": list(buffers.values())}).pull(plan, region, verify=True)
    return plan, staging, region, stats


def by_shard(partial: PartialSums) -> dict[tuple[str, int], tuple[int, int]]:
    """(units read, WSUM-64) of each partial read, by (parameter, shard)."""
    return {
        partial.order.name(position): (units, value)
        for position, units, value in zip(
            partial.positions.tolist(), partial.units.tolist(), partial.sums.tolist(), strict=True
        )
    }


def no_partial_reads(order: ShardOrder) -> PartialSums:
    """A worker's sums when it read no shard in parts."""
    none = np.zeros(0, np.int64)
    return PartialSums(order, none, none, none.astype(np.uint64), none.astype(np.uint64))
