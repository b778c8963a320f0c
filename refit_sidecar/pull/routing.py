"""The manifest a receiver plans from when the tree chose its sources (docs/fanout.md).

The sidecar answers GetSources with routes, pieces that tile each want once, each with a
primary source, and with each source's shards. `route_manifest` keeps, per route, only the
primary's shards clipped to the route's box, so `plan.plan_pull` finds exactly one holder for
every byte and reads what the tree chose; its targets are those of the receiver's own plan
(same wants, same order), so the bytes land where that plan expects them.
"""

from __future__ import annotations

from collections.abc import Mapping

from refit_sidecar.core.manifest import (
    AgentRecord,
    Box,
    DType,
    Manifest,
    ParameterRecord,
    ShardPiece,
    ShardRecord,
)
from refit_sidecar.core.tree_records import NodeKind
from refit_sidecar.service.sources import Sources


def clip(shard: ShardRecord, box: Box) -> ShardRecord | None:
    """`shard` holding only its bytes inside `box` (None when it holds none). The checksums are
    dropped unless every piece stays whole: the receiver checks against the trainer's own
    checksums, not a copy's."""
    pieces = []
    for piece in shard.pieces:
        inter = piece.box.intersect(box)
        if inter is None:
            continue
        local = tuple(
            ls + s - p
            for ls, s, p in zip(piece.local_start, inter.start, piece.box.start, strict=True)
        )
        pieces.append(ShardPiece(inter, local))
    if not pieces:
        return None
    whole = tuple(pieces) == shard.pieces
    return ShardRecord(
        shard.location,
        tuple(pieces),
        shard.crc32 if whole else None,
        shard.rank,
        shard.tensor_rank,
        shard.pipeline_stage,
        shard.sum64 if whole else None,
    )


def route_manifest(sources: Sources) -> Manifest:
    """The primaries' shards, clipped to their routes."""
    found: dict[str, tuple[tuple[int, ...], DType, list[ShardRecord]]] = {}
    agents: dict[str, AgentRecord] = {}
    for route in sources.routes:
        copy = sources.copies.get(route.primary)
        if copy is None:
            raise ValueError(f"route of {route.name!r} names source {route.primary!r}, not sent")
        record = copy.shards.get(route.name)
        if record is None:
            raise ValueError(f"source {route.primary!r} was sent without {route.name!r}")
        entry = found.setdefault(route.name, (record.shape, record.dtype, []))
        for shard in record.shards:
            clipped = clip(shard, route.box)
            if clipped is not None:
                entry[2].append(clipped)
        agents.update(copy.shards.agents)
    records = tuple(
        ParameterRecord(name, shape, dtype, tuple(shards))
        for name, (shape, dtype, shards) in found.items()
    )
    return Manifest(sources.version, records, agents)


def peer_bases(sources: Sources, primaries: Mapping[str, object] | None = None) -> dict[str, int]:
    """Per peer source, the address its copy starts at (its progress counts from there)."""
    out = {}
    for source_id, copy in sources.copies.items():
        if copy.kind is not NodeKind.PEER:
            continue
        if primaries is not None and source_id not in primaries:
            continue
        out[source_id] = min(
            shard.location.address for record in copy.shards.parameters for shard in record.shards
        )
    return out
