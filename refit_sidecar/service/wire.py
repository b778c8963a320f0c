"""Exact conversions between the manifest's domain records and the refit.proto messages.

Every `*_to_proto` / `*_from_proto` pair round-trips: `x_from_proto(x_to_proto(x)) == x`, with
one documented narrowing: the wire's `SourceAgent` carries an agent's NIXL metadata blob (and
rank) only, not the metadata listener (`AgentRecord.host`/`port`). `agent_to_proto` therefore
requires the blob and drops the listener; an agent record without host and port (what a source
without a listener publishes) round-trips exactly.

Enums: `DType` <-> common.proto `DType`, `MemType` <-> refit.proto `MemoryKind`. Unspecified or
unknown wire values raise ValueError naming the valid ones. Values out of a proto field's range
(a negative address, a rank past uint32) raise ValueError as well (protobuf's own check).

A manifest's `layout` (the trainer's ParallelLayout) has no domain counterpart: it is written
when given and ignored when read. `publish_request`/`partial_from_request` convert one rank's
part of a version (its one agent and its shards) to and from a `PublishShardsRequest`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from refit_sidecar.core.manifest import (
    AgentRecord,
    Box,
    DType,
    Manifest,
    MemType,
    ParameterRecord,
    ShardLocation,
    ShardPiece,
    ShardRecord,
    SnapshotPieces,
)
from refit_sidecar.core.plan import Checksums
from refit_sidecar.core.shared_word_ref import ProgressFileRef
from trainer_refit.v1 import common_pb2
from trainer_refit.v1 import refit_pb2 as pb

_DTYPES: dict[DType, common_pb2.DType] = {
    d: common_pb2.DType.Value(f"DTYPE_{d.name}") for d in DType
}
_DTYPES_BACK: dict[int, DType] = {int(v): d for d, v in _DTYPES.items()}
_MEMORY: dict[MemType, pb.MemoryKind] = {
    m: pb.MemoryKind.Value(f"MEMORY_KIND_{m.name}") for m in MemType
}
_MEMORY_BACK: dict[int, MemType] = {int(v): m for m, v in _MEMORY.items()}


def _unknown(kind: str, value: int, valid: Iterable[str]) -> ValueError:
    return ValueError(f"unknown or unspecified {kind} {value}; valid: {', '.join(valid)}")


# -- enums -------------------------------------------------------------------------------------


def dtype_to_proto(dtype: DType) -> common_pb2.DType:
    return _DTYPES[dtype]


def dtype_from_proto(value: int) -> DType:
    dtype = _DTYPES_BACK.get(value)
    if dtype is None:
        names = (common_pb2.DType.Name(v) for v in _DTYPES.values())
        raise _unknown("DType", value, names)
    return dtype


def mem_type_to_proto(mem_type: MemType) -> pb.MemoryKind:
    return _MEMORY[mem_type]


def mem_type_from_proto(value: int) -> MemType:
    mem_type = _MEMORY_BACK.get(value)
    if mem_type is None:
        raise _unknown("MemoryKind", value, (pb.MemoryKind.Name(v) for v in _MEMORY.values()))
    return mem_type


# -- boxes and shards --------------------------------------------------------------------------


def box_to_proto(box: Box) -> pb.Box:
    return pb.Box(start=box.start, stop=[stop for _, stop in box.ranges])


def box_from_proto(message: pb.Box) -> Box:
    if len(message.start) != len(message.stop):
        raise ValueError(f"box with {len(message.start)} starts and {len(message.stop)} stops")
    return Box(tuple(zip(message.start, message.stop, strict=True)))


def piece_to_proto(piece: ShardPiece) -> pb.ShardPiece:
    return pb.ShardPiece(box=box_to_proto(piece.box), local_start=piece.local_start)


def piece_from_proto(message: pb.ShardPiece) -> ShardPiece:
    return ShardPiece(box_from_proto(message.box), tuple(message.local_start))


def location_to_proto(location: ShardLocation) -> pb.ShardLocation:
    return pb.ShardLocation(
        agent=location.agent,
        address=location.address,
        nbytes=location.nbytes,
        shape=location.shape,
        strides=location.strides,
        memory=mem_type_to_proto(location.mem_type),
        device_id=location.device_id,
    )


def location_from_proto(message: pb.ShardLocation) -> ShardLocation:
    return ShardLocation(
        agent=message.agent,
        address=message.address,
        nbytes=message.nbytes,
        shape=tuple(message.shape),
        strides=tuple(message.strides),
        mem_type=mem_type_from_proto(message.memory),
        device_id=message.device_id,
    )


def checksums_from_proto(message: pb.ShardRecord | pb.ShardChecksums) -> Checksums:
    """The checksums a shard record (or a lease's `ShardChecksums`) carries."""
    return Checksums(
        message.crc32 if message.HasField("crc32") else None,
        message.wsum64 if message.HasField("wsum64") else None,
    )


def set_checksums(message: pb.ShardRecord | pb.ShardChecksums, sums: Checksums) -> None:
    """Store `sums` in a shard record (or a lease's `ShardChecksums`); None leaves a field
    unset."""
    if sums.crc32 is not None:
        message.crc32 = sums.crc32
    if sums.sum64 is not None:
        message.wsum64 = sums.sum64


def shard_to_proto(shard: ShardRecord) -> pb.ShardRecord:
    message = pb.ShardRecord(
        location=location_to_proto(shard.location),
        pieces=[piece_to_proto(p) for p in shard.pieces],
        rank=shard.rank,
        tensor_rank=shard.tensor_rank,
        pipeline_stage=shard.pipeline_stage,
        expert_rank=shard.expert_rank,
        expert_tensor_rank=shard.expert_tensor_rank,
    )
    set_checksums(message, Checksums(shard.crc32, shard.sum64))
    return message


def shard_from_proto(message: pb.ShardRecord) -> ShardRecord:
    if not message.HasField("location"):
        raise ValueError("a shard record needs a location")
    sums = checksums_from_proto(message)
    return ShardRecord(
        location=location_from_proto(message.location),
        pieces=tuple(piece_from_proto(p) for p in message.pieces),
        crc32=sums.crc32,
        rank=message.rank,
        tensor_rank=message.tensor_rank,
        pipeline_stage=message.pipeline_stage,
        sum64=sums.sum64,
        expert_rank=message.expert_rank,
        expert_tensor_rank=message.expert_tensor_rank,
    )


def parameter_to_proto(parameter: ParameterRecord) -> pb.ParameterRecord:
    return pb.ParameterRecord(
        name=parameter.name,
        shape=parameter.shape,
        dtype=dtype_to_proto(parameter.dtype),
        shards=[shard_to_proto(s) for s in parameter.shards],
    )


def parameter_from_proto(message: pb.ParameterRecord) -> ParameterRecord:
    return ParameterRecord(
        name=message.name,
        shape=tuple(message.shape),
        dtype=dtype_from_proto(message.dtype),
        shards=tuple(shard_from_proto(s) for s in message.shards),
    )


# -- agents and manifests ----------------------------------------------------------------------


def agent_to_proto(agent: AgentRecord) -> pb.SourceAgent:
    """The agent's name, metadata blob and rank. The wire has no metadata listener: the blob
    is required (ValueError without it) and `host`/`port` are not carried."""
    if not agent.metadata:
        raise ValueError(
            f"agent {agent.name!r} has no metadata blob; the wire carries agents' metadata only "
            "(no listener host/port), so a published agent must include it"
        )
    message = pb.SourceAgent(name=agent.name, metadata=agent.metadata, rank=agent.rank)
    if agent.version_word is not None:
        message.version_word.CopyFrom(location_to_proto(agent.version_word))
    if agent.pieces is not None:
        pieces = agent.pieces
        message.pieces.words.CopyFrom(location_to_proto(pieces.words))
        message.pieces.slot_address = pieces.slot_address
        message.pieces.ends.extend(pieces.ends)
    return message


def agent_from_proto(message: pb.SourceAgent) -> AgentRecord:
    if not message.name:
        raise ValueError("a source agent needs a name")
    word = location_from_proto(message.version_word) if message.HasField("version_word") else None
    pieces = None
    if message.HasField("pieces"):
        got = message.pieces
        pieces = SnapshotPieces(location_from_proto(got.words), got.slot_address, tuple(got.ends))
    return AgentRecord(
        message.name,
        metadata=message.metadata,
        rank=message.rank,
        version_word=word,
        pieces=pieces,
    )


def manifest_to_proto(
    manifest: Manifest, layout: common_pb2.ParallelLayout | None = None
) -> pb.Manifest:
    return pb.Manifest(
        version=manifest.version,
        layout=layout,
        parameters=[parameter_to_proto(p) for p in manifest.parameters],
        agents=[agent_to_proto(a) for a in manifest.agents.values()],
    )


def manifest_key(manifest: pb.Manifest | pb.PublishShardsRequest) -> bytes:
    """A digest of the manifest (or of one rank's report) with its version and checksums
    cleared: where its shards lie (`Lease.manifest_key`, a source copy's key in a GetSources
    answer, the layouts of reports the sidecar has checked)."""
    bare = type(manifest)()
    bare.CopyFrom(manifest)
    bare.version = 0
    if isinstance(bare, pb.PublishShardsRequest):
        bare.generation = 0
    for parameter in bare.parameters:
        for shard in parameter.shards:
            shard.ClearField("crc32")
            shard.ClearField("wsum64")
    return hashlib.blake2b(bare.SerializeToString(deterministic=True), digest_size=16).digest()


def manifest_from_proto(message: pb.Manifest) -> Manifest:
    """The manifest (its `layout` is not part of the domain record)."""
    agents: dict[str, AgentRecord] = {}
    for agent in map(agent_from_proto, message.agents):
        if agents.setdefault(agent.name, agent) != agent:
            raise ValueError(f"agent {agent.name!r} is listed twice, differently")
    return Manifest(
        message.version,
        tuple(parameter_from_proto(p) for p in message.parameters),
        agents,
    )


# -- one rank's part of a version --------------------------------------------------------------


def publish_request(version: int, rank: int, partial: Manifest) -> pb.PublishShardsRequest:
    """The PublishShards request of `rank` for `version`: `partial` must be that rank's part,
    of that version, with exactly one agent (the rank's source; its `rank` must be `rank`)."""
    if partial.version != version:
        raise ValueError(f"partial manifest is of version {partial.version}, not {version}")
    if len(partial.agents) != 1:
        raise ValueError(
            f"a rank publishes through one source agent, the partial manifest has "
            f"{sorted(partial.agents)}"
        )
    (agent,) = partial.agents.values()
    if agent.rank != rank:
        raise ValueError(f"agent {agent.name!r} serves rank {agent.rank}, not rank {rank}")
    return pb.PublishShardsRequest(
        version=version,
        rank=rank,
        agent=agent_to_proto(agent),
        parameters=[parameter_to_proto(p) for p in partial.parameters],
    )


def partial_from_request(request: pb.PublishShardsRequest) -> tuple[int, int, Manifest]:
    """(version, rank, partial manifest) of a PublishShards request; inverse of
    `publish_request`. ValueError for a report that does not parse, or names memory other than
    its own agent's (`Manifest` knows no other agent)."""
    if not request.HasField("agent"):
        raise ValueError("a publish request needs its source agent")
    agent = agent_from_proto(request.agent)
    partial = Manifest(
        request.version,
        tuple(parameter_from_proto(p) for p in request.parameters),
        {agent.name: agent},
    )
    if agent.rank != request.rank:
        raise ValueError(f"the report of rank {request.rank} names agent rank {agent.rank}")
    return request.version, request.rank, partial


def progress_file_to_proto(ref: ProgressFileRef | None) -> pb.ProgressFile | None:
    return None if ref is None else pb.ProgressFile(host=ref.host, path=ref.path)


def progress_file_from_proto(message: pb.SourceCopy | pb.PeerOffer) -> ProgressFileRef | None:
    if not message.HasField("progress_file"):
        return None
    return ProgressFileRef(message.progress_file.host, message.progress_file.path)
