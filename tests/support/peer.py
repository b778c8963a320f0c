"""A receiver's staged copy of a version, described as a source other receivers can read.

After a pull, a receiver's staging buffer holds each wanted box of a global tensor back to back
in C order (`plan.PullTarget`). `staged_manifest` lists exactly those boxes as shards of a
`Manifest` whose buffers live in the receiver's own memory, so the planner that reads from the
trainer's ranks reads from a peer unchanged: a receiver with another TP layout reads the
intersection of its boxes with the peer's, and where a peer and the trainer hold the same bytes
the planner spreads the reads over them (`plan.plan_pull`). This is the data half of tree
fan-out (docs/fanout.md); `tree.Tree` decides who reads from whom.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from refit_sidecar.core.manifest import (
    AgentRecord,
    Manifest,
    MemType,
    ParameterRecord,
    ShardLocation,
    ShardPiece,
    ShardRecord,
)
from refit_sidecar.core.plan import PullPlan


def staged_manifest(
    plan: PullPlan,
    shapes: Mapping[str, Sequence[int]],
    *,
    agent: AgentRecord,
    address: int,
    mem_type: MemType = MemType.DRAM,
    device_id: int = 0,
    checksums: Sequence[int | None] | None = None,
) -> Manifest:
    """The boxes `plan` staged at `address` (the staging buffer's first byte, registered with
    `agent`) as a manifest of version `plan.version`. `shapes`: each parameter's global shape
    (the source manifest's). `checksums`: the CRC-32 of each target's bytes, in
    `plan.targets` order, when the receiver verified or computed them."""
    if checksums is not None and len(checksums) != len(plan.targets):
        raise ValueError(f"{len(checksums)} checksums for {len(plan.targets)} staged boxes")
    shards: dict[str, list[ShardRecord]] = {}
    dtypes = {}
    for i, target in enumerate(plan.targets):
        if target.name not in shapes:
            raise ValueError(f"no global shape given for {target.name!r}")
        location = ShardLocation.contiguous(
            agent=agent.name,
            address=address + target.offset,
            shape=target.box.shape,
            itemsize=target.dtype.itemsize,
            mem_type=mem_type,
            device_id=device_id,
        )
        piece = ShardPiece(target.box, (0,) * target.box.ndim)
        crc = None if checksums is None else checksums[i]
        shards.setdefault(target.name, []).append(ShardRecord(location, (piece,), crc))
        dtypes[target.name] = target.dtype
    records = tuple(
        ParameterRecord(name, tuple(shapes[name]), dtypes[name], tuple(found))
        for name, found in shards.items()
    )
    return Manifest(plan.version, records, {agent.name: agent})


def with_peers(manifest: Manifest, peers: Sequence[Manifest]) -> Manifest:
    """`manifest` with the shards of `peers` (of the same version) added: the planner then
    reads each byte once, from whichever holder has the fewest bytes assigned so far."""
    records = {p.name: p for p in manifest.parameters}
    agents = dict(manifest.agents)
    for peer in peers:
        if peer.version != manifest.version:
            raise ValueError(f"a peer of version {peer.version} for version {manifest.version}")
        for record in peer.parameters:
            known = records.get(record.name)
            if known is None:
                raise ValueError(f"peer holds {record.name!r}, which version {peer.version} lacks")
            if (known.shape, known.dtype) != (record.shape, record.dtype):
                raise ValueError(
                    f"peer's {record.name!r} is {record.dtype.value}{list(record.shape)}, the "
                    f"version's {known.dtype.value}{list(known.shape)}"
                )
            records[record.name] = ParameterRecord(
                known.name, known.shape, known.dtype, known.shards + record.shards
            )
        for name, agent in peer.agents.items():
            if name in agents and agents[name] != agent:
                raise ValueError(f"two different agents named {name!r}")
            agents[name] = agent
    return Manifest(manifest.version, tuple(records.values()), agents)
