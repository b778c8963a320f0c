"""Domain records <-> refit.proto messages: exact round trips, enum errors, and the sidecar's
GetManifest merge of per-rank PublishShards requests agreeing with `merge_manifests`."""

from __future__ import annotations

import asyncio
import math
import random

import pytest

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
    c_strides,
    merge_manifests,
)
from refit_sidecar.publish.shard_specs import split_pieces
from refit_sidecar.service.registry import Registry, RegistryConfig
from refit_sidecar.service.server import RefitServicer
from refit_sidecar.service.wire import (
    agent_from_proto,
    agent_to_proto,
    box_from_proto,
    box_to_proto,
    dtype_from_proto,
    dtype_to_proto,
    manifest_from_proto,
    manifest_to_proto,
    mem_type_from_proto,
    mem_type_to_proto,
    parameter_from_proto,
    parameter_to_proto,
    partial_from_request,
    publish_request,
    shard_from_proto,
    shard_to_proto,
)
from trainer_refit.v1 import common_pb2
from trainer_refit.v1 import refit_pb2 as pb

FC1 = "decoder.layers.{}.mlp.linear_fc1.weight"
FC2 = "decoder.layers.{}.mlp.linear_fc2.weight"
NORM = "decoder.layers.{}.input_layernorm.weight"


def _location(
    rng: random.Random, agent: str, local_shape: tuple[int, ...], dtype: DType, strided: bool
) -> ShardLocation:
    mem_type = rng.choice(list(MemType))
    device_id = rng.randrange(8) if mem_type is MemType.VRAM else 0
    address = rng.randrange(0, 2**64 - 2**32, 256)
    if not strided or len(local_shape) < 2:
        return ShardLocation.contiguous(
            agent=agent,
            address=address,
            shape=local_shape,
            itemsize=dtype.itemsize,
            mem_type=mem_type,
            device_id=device_id,
        )
    # A view of a wider buffer: rows padded to a larger pitch.
    pitch = local_shape[-1] + rng.randrange(1, 9)
    strides = (*c_strides((*local_shape[:-1], pitch))[:-1], 1)
    nbytes = math.prod(local_shape[:-1]) * pitch * dtype.itemsize
    return ShardLocation(
        agent=agent,
        address=address,
        nbytes=nbytes,
        shape=local_shape,
        strides=strides,
        mem_type=mem_type,
        device_id=device_id,
    )


def _parameter(
    rng: random.Random,
    name: str,
    agents: list[AgentRecord],
    tp: int,
    ranks: range,
    *,
    kinds: dict[str, tuple[DType, int]] | None = None,
) -> ParameterRecord:
    """Shards of TP ranks `ranks` (of `tp`): fc1 with two pieces each, fc2 split on dim 1,
    norms replicated, some strided, with and without a CRC. `kinds` fixes each name's dtype and
    size across calls (for the parts of one version)."""
    kinds = {} if kinds is None else kinds
    dtype, hidden = kinds.setdefault(name, (rng.choice(list(DType)), 4 * tp * rng.randrange(1, 4)))
    if "fc1" in name:
        shape: tuple[int, ...] = (2 * hidden, hidden)
        dim, parts = 0, 2
    elif "fc2" in name:
        shape, dim, parts = (hidden, 2 * hidden), 1, 1
    else:
        shape, dim, parts = (hidden,), None, 1
    shards = []
    for rank in ranks:
        local_shape, pieces = split_pieces(shape, dim, parts, rank, tp)
        agent = agents[rank]
        strided = rng.random() < 0.5
        shards.append(
            ShardRecord(
                _location(rng, agent.name, local_shape, dtype, strided),
                pieces,
                crc32=rng.randrange(2**32) if rng.random() < 0.5 else None,
                rank=agent.rank,
                tensor_rank=rank,
                pipeline_stage=rng.randrange(3),
                expert_rank=rng.randrange(4),
                expert_tensor_rank=rng.randrange(2),
            )
        )
    return ParameterRecord(name, shape, dtype, tuple(shards))


def _agents(tp: int, tag: str = "src") -> list[AgentRecord]:
    return [
        AgentRecord(f"{tag}-{r}", metadata=b"nixl-md\x00" + bytes([r]) * 7, rank=r)
        for r in range(tp)
    ]


def _random_manifest(seed: int) -> Manifest:
    rng = random.Random(seed)
    tp = rng.choice([1, 2, 4])
    agents = _agents(tp)
    names = [t.format(layer) for layer in range(rng.randrange(1, 4)) for t in (FC1, FC2, NORM)]
    parameters = tuple(_parameter(rng, n, agents, tp, range(tp)) for n in names)
    return Manifest(rng.randrange(1, 2**40), parameters, {a.name: a for a in agents})


@pytest.mark.parametrize("seed", range(20))
def test_random_manifests_round_trip(seed: int) -> None:
    manifest = _random_manifest(seed)
    layout = common_pb2.ParallelLayout(tensor_parallel=2, world_size=2)
    message = manifest_to_proto(manifest, layout)
    wire = pb.Manifest.FromString(message.SerializeToString())
    assert wire.layout == layout
    assert manifest_from_proto(wire) == manifest
    for parameter in manifest.parameters:
        assert parameter_from_proto(parameter_to_proto(parameter)) == parameter
        for shard in parameter.shards:
            assert shard_from_proto(shard_to_proto(shard)) == shard


def test_the_sample_covers_what_it_claims() -> None:
    shards = [s for seed in range(20) for p in _random_manifest(seed).parameters for s in p.shards]
    assert any(len(s.pieces) == 2 for s in shards)
    assert any(s.location.strides != c_strides(s.location.shape) for s in shards)
    assert {s.crc32 is None for s in shards} == {True, False}
    assert {s.location.mem_type for s in shards} == set(MemType)
    crc_zero = ShardRecord(shards[0].location, shards[0].pieces, crc32=0)
    assert shard_to_proto(crc_zero).HasField("crc32")
    assert shard_from_proto(shard_to_proto(crc_zero)) == crc_zero


def test_enums_map_every_member_and_reject_unspecified() -> None:
    for dtype in DType:
        assert dtype_from_proto(dtype_to_proto(dtype)) is dtype
        assert common_pb2.DType.Name(dtype_to_proto(dtype)) == f"DTYPE_{dtype.name}"
    for mem_type in MemType:
        assert mem_type_from_proto(mem_type_to_proto(mem_type)) is mem_type
    with pytest.raises(ValueError, match="DTYPE_BFLOAT16"):
        dtype_from_proto(common_pb2.DTYPE_UNSPECIFIED)
    with pytest.raises(ValueError, match="DTYPE_UINT8"):
        dtype_from_proto(99)
    with pytest.raises(ValueError, match="MEMORY_KIND_VRAM"):
        mem_type_from_proto(pb.MEMORY_KIND_UNSPECIFIED)
    record = pb.ParameterRecord(name="w", shape=[4])  # dtype left unspecified
    with pytest.raises(ValueError, match="unspecified DType"):
        parameter_from_proto(record)
    location = pb.ShardLocation(agent="a", nbytes=16, shape=[4], strides=[1])  # no memory kind
    shard = pb.ShardRecord(
        location=location, pieces=[pb.ShardPiece(box=pb.Box(start=[0], stop=[4]), local_start=[0])]
    )
    with pytest.raises(ValueError, match="MEMORY_KIND_DRAM"):
        shard_from_proto(shard)


def test_boxes_and_agents() -> None:
    box = Box(((0, 3), (5, 9), (1, 2)))
    assert box_from_proto(box_to_proto(box)) == box
    assert box_from_proto(box_to_proto(Box(()))) == Box(())
    with pytest.raises(ValueError, match="starts"):
        box_from_proto(pb.Box(start=[0, 0], stop=[1]))
    agent = AgentRecord("a", metadata=b"blob", rank=3)
    assert agent_from_proto(agent_to_proto(agent)) == agent
    with pytest.raises(ValueError, match="metadata blob"):
        agent_to_proto(AgentRecord("a", host="127.0.0.1", port=5555))
    listening = AgentRecord("a", metadata=b"blob", host="127.0.0.1", port=5555, rank=3)
    assert agent_from_proto(agent_to_proto(listening)) == agent  # the listener is not carried
    with pytest.raises(ValueError):
        shard_from_proto(pb.ShardRecord())  # no location
    piece = ShardPiece(Box(((2, 4),)), (0,))
    assert ShardPiece(box_from_proto(box_to_proto(piece.box)), piece.local_start) == piece


def _partial(
    rng: random.Random,
    version: int,
    rank: int,
    tp: int,
    names: list[str],
    *,
    kinds: dict[str, tuple[DType, int]],
) -> Manifest:
    agents = _agents(tp, tag="rank")
    ranks = range(rank, rank + 1)
    parameters = tuple(_parameter(rng, n, agents, tp, ranks, kinds=kinds) for n in names)
    return Manifest(version, parameters, {agents[rank].name: agents[rank]})


def _sorted(manifest: Manifest) -> Manifest:
    parameters = tuple(sorted(manifest.parameters, key=lambda p: p.name))
    return Manifest(manifest.version, parameters, dict(manifest.agents))


def test_publish_request_round_trip_and_checks() -> None:
    rng = random.Random(7)
    kinds: dict[str, tuple[DType, int]] = {}
    partial = _partial(rng, 5, 1, 2, [FC1.format(0), NORM.format(0)], kinds=kinds)
    request = publish_request(5, 1, partial)
    again = pb.PublishShardsRequest.FromString(request.SerializeToString())
    assert partial_from_request(again) == (5, 1, partial)
    with pytest.raises(ValueError, match="version"):
        publish_request(6, 1, partial)
    with pytest.raises(ValueError, match="rank"):
        publish_request(5, 0, partial)
    both = merge_manifests([partial, _partial(rng, 5, 0, 2, [FC1.format(0)], kinds=kinds)])
    with pytest.raises(ValueError, match="one source agent"):
        publish_request(5, 1, both)
    with pytest.raises(ValueError, match="agent"):
        partial_from_request(pb.PublishShardsRequest(version=5, rank=1))
    again.rank = 0  # another rank's report naming rank 1's agent
    with pytest.raises(ValueError, match="report of rank 0 names agent rank 1"):
        partial_from_request(again)


@pytest.mark.parametrize("seed", range(5))
def test_sidecar_merge_equals_merge_manifests(seed: int) -> None:
    """Two ranks publish overlapping and disjoint parameters through the servicer; its
    GetManifest, converted back, is `merge_manifests` of the two parts (sorted by name, as the
    sidecar lists parameters)."""
    rng = random.Random(seed)
    names = [t.format(layer) for layer in range(2) for t in (FC1, FC2, NORM)]
    rng.shuffle(names)
    kinds: dict[str, tuple[DType, int]] = {}
    rank0 = _partial(rng, 3, 0, 2, names[:4], kinds=kinds)
    rank1 = _partial(rng, 3, 1, 2, names[2:], kinds=kinds)
    layout = common_pb2.ParallelLayout(tensor_parallel=2, world_size=2)

    async def run() -> pb.Manifest:
        servicer = RefitServicer(Registry(RegistryConfig()))
        register = pb.RegisterTrainerRequest(layout=layout, num_slots=2, owner="trainer")
        generation = (await servicer.RegisterTrainer(register, None)).generation
        await servicer.ReserveSlot(pb.ReserveSlotRequest(version=3, generation=generation), None)
        reports = [publish_request(3, rank, part) for rank, part in ((1, rank1), (0, rank0))]
        for report in reports:
            report.generation = generation
        first = await servicer.PublishShards(reports[0], None)
        second = await servicer.PublishShards(reports[1], None)
        assert (first.visible, second.visible) == (False, True)
        return await servicer.GetManifest(pb.GetManifestRequest(version=3), None)

    message = asyncio.run(run())
    assert message.layout == layout
    merged = manifest_from_proto(message)
    assert merged == _sorted(merge_manifests([rank0, rank1]))
    assert list(merged.agents) == ["rank-0", "rank-1"]
