"""The manifest a receiver plans from when the tree chose its sources (docs/fanout.md).

The sidecar answers GetSources with routes, pieces that tile each want once, each with a
primary source, and with each source's shards. `route_manifest` keeps, per route, only the
primary's shards clipped to the route's box, so `plan.plan_pull` finds exactly one holder for
every byte and reads what the tree chose; its targets are those of the receiver's own plan
(same wants, same order), so the bytes land where that plan expects them. In the two usual
cases `one_source` gives the routed plan without parsing or planning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from refit_sidecar.core.manifest import (
    AgentRecord,
    Box,
    DType,
    Manifest,
    ParameterRecord,
    ShardLocation,
    ShardPiece,
    ShardRecord,
)
from refit_sidecar.core.plan import PullPlan, ShardReads
from refit_sidecar.core.tree_records import NodeKind
from refit_sidecar.pull.peer_words import PeerGate
from refit_sidecar.service.sources import Answer, Sources
from refit_sidecar.service.wire import (
    agent_from_proto,
    location_from_proto,
    mem_type_from_proto,
    progress_file_from_proto,
)
from trainer_refit.v1 import refit_pb2 as pb


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
    return replace(
        shard,
        pieces=tuple(pieces),
        crc32=shard.crc32 if whole else None,
        sum64=shard.sum64 if whole else None,
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


def one_source(answer: Answer, plan: PullPlan) -> tuple[PullPlan, dict[str, PeerGate]] | None:
    """The routed plan without parsing or planning, in the two usual cases: every route's
    primary is the one trainer rank this receiver's own plan reads from (the plan itself), or
    one peer whose copy holds each wanted box whole (one read per box, from where the peer
    holds it). None otherwise: the caller plans from the answer's manifests."""
    primaries = answer.primaries
    if len(primaries) != 1:
        return None
    (primary,) = primaries
    copy = next((c for c in answer.reply.sources if c.source_id == primary), None)
    if copy is None:
        return None
    if copy.kind == pb.SOURCE_KIND_TRAINER:
        if set(plan.agents) != {primary}:
            return None
        return replace(plan, version=answer.version), {}
    if copy.kind != pb.SOURCE_KIND_PEER or not copy.HasField("progress"):
        return None
    routes = answer.reply.routes
    if len(routes) != len(plan.targets) or len(copy.shards.agents) != 1:
        return None
    held: dict[tuple[str, tuple[int, ...], tuple[int, ...]], pb.ShardLocation] = {}
    for parameter in copy.shards.parameters:
        for shard in parameter.shards:
            if len(shard.pieces) == 1 and not any(shard.pieces[0].local_start):
                box = shard.pieces[0].box
                held[(parameter.name, tuple(box.start), tuple(box.stop))] = shard.location
    locations = []
    for route, target in zip(routes, plan.targets, strict=True):
        stop = tuple(end for _, end in target.box.ranges)
        key = (target.name, target.box.start, stop)
        if (route.name, tuple(route.box.start), tuple(route.box.stop)) != key:
            return None
        location = held.get(key)
        if location is None or location.nbytes != target.nbytes:
            return None
        locations.append(location)
    # The copy's first byte, from which its progress word counts (`routing.peer_bases`).
    base = min(s.location.address for p in copy.shards.parameters for s in p.shards)
    end = max(loc.address + loc.nbytes for loc in locations)
    first = locations[0]
    whole = ShardLocation(
        agent=primary,
        address=base,
        nbytes=end - base,
        shape=(end - base,),
        strides=(1,),
        mem_type=mem_type_from_proto(first.memory),
        device_id=first.device_id,
    )
    reads = ShardReads(
        parameter="",
        shard=0,
        location=whole,
        crc32=None,
        complete=False,
        shard_offsets=np.array([loc.address - base for loc in locations], np.int64),
        lengths=np.array([t.nbytes for t in plan.targets], np.int64),
        dest_offsets=np.array([t.offset for t in plan.targets], np.int64),
    )
    routed = replace(
        plan,
        version=answer.version,
        reads=(reads,),
        agents={primary: agent_from_proto(copy.shards.agents[0])},
    )
    gate = PeerGate(location_from_proto(copy.progress), base, progress_file_from_proto(copy))
    return routed, {primary: gate}
