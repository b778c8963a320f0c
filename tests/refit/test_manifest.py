"""Manifest records: boxes, validation, merging per-rank manifests, TP pieces."""

from __future__ import annotations

import dataclasses

import pytest

from refit_sidecar.core.manifest import (
    AgentRecord,
    Box,
    DType,
    Manifest,
    ParameterRecord,
    ShardLocation,
    ShardPiece,
    ShardRecord,
    c_strides,
    merge_manifests,
)
from refit_sidecar.publish.shard_specs import split_pieces


def test_box_arithmetic() -> None:
    a = Box(((0, 4), (2, 6)))
    assert a.shape == (4, 4) and a.start == (0, 2) and a.numel == 16 and a.ndim == 2
    assert a.intersect(Box(((3, 8), (0, 3)))) == Box(((3, 4), (2, 3)))
    assert a.intersect(Box(((4, 8), (0, 6)))) is None
    assert a.contains(Box(((1, 2), (2, 6)))) and not a.contains(Box(((1, 2), (1, 6))))
    assert a.within((4, 6)) and not a.within((4, 5)) and not a.within((4,))
    assert Box.at((1, 2), (3, 4)) == Box(((1, 4), (2, 6)))
    assert Box.full((2, 3)) == Box(((0, 2), (0, 3)))
    for bad in [((2, 2),), ((3, 1),), ((-1, 1),)]:
        with pytest.raises(ValueError):
            Box(bad)
    assert c_strides((2, 3, 4)) == (12, 4, 1) and c_strides(()) == ()
    assert DType.BFLOAT16.itemsize == 2 and DType.INT64.itemsize == 8


def test_split_pieces_fc1_rank_holds_gate_and_up_blocks() -> None:
    local, pieces = split_pieces((16, 3), dim=0, parts=2, rank=1, size=4)
    assert local == (4, 3)
    assert pieces == (
        ShardPiece(Box(((2, 4), (0, 3))), (0, 0)),
        ShardPiece(Box(((10, 12), (0, 3))), (2, 0)),
    )
    local, pieces = split_pieces((3, 8), dim=1, parts=1, rank=1, size=2)
    assert local == (3, 4) and pieces == (ShardPiece(Box(((0, 3), (4, 8))), (0, 0)),)
    assert split_pieces((5,), None, 1, 1, 2) == ((5,), (ShardPiece(Box(((0, 5),)), (0,)),))
    with pytest.raises(ValueError, match="cannot be split"):
        split_pieces((6, 3), dim=0, parts=2, rank=0, size=2)
    with pytest.raises(ValueError, match="out of range"):
        split_pieces((8, 3), dim=0, parts=1, rank=2, size=2)


def _record(agent: str, name: str = "w", rows: tuple[int, int] = (0, 2)) -> ParameterRecord:
    location = ShardLocation.contiguous(agent=agent, address=4096, shape=(2, 3), itemsize=4)
    piece = ShardPiece(Box((rows, (0, 3))), (0, 0))
    return ParameterRecord(name, (4, 3), DType.FLOAT32, (ShardRecord(location, (piece,)),))


def test_records_are_validated() -> None:
    location = ShardLocation.contiguous(agent="a", address=0, shape=(2, 3), itemsize=4)
    assert location.nbytes == 24 and location.strides == (3, 1) and location.span(4) == 24
    with pytest.raises(ValueError, match="outside"):
        _record("a", rows=(3, 5))
    with pytest.raises(ValueError, match="outside local"):
        ParameterRecord(
            "w",
            (4, 3),
            DType.FLOAT32,
            (ShardRecord(location, (ShardPiece(Box(((0, 2), (0, 3))), (1, 0)),)),),
        )
    with pytest.raises(ValueError, match="exceeds"):
        ParameterRecord("w", (4, 3), DType.INT64, (ShardRecord(location, ()),))
    with pytest.raises(ValueError, match="strides"):
        dataclasses.replace(location, strides=(3,))
    with pytest.raises(ValueError, match="unknown agent"):
        Manifest(1, (_record("a"),), {})
    with pytest.raises(ValueError, match="unique"):
        Manifest(1, (_record("a"), _record("a")), {"a": AgentRecord("a", b"m")})
    with pytest.raises(ValueError, match="metadata or a listener"):
        AgentRecord("a")
    assert AgentRecord("a", host="h", port=5).port == 5


def test_merge_pools_the_shards_of_each_rank() -> None:
    rank0 = Manifest(3, (_record("a"),), {"a": AgentRecord("a", b"ma")})
    rank1 = Manifest(
        3, (_record("b", rows=(2, 4)), _record("b", "v")), {"b": AgentRecord("b", b"mb")}
    )
    merged = merge_manifests([rank0, rank1])
    assert merged.version == 3 and merged.names == ("w", "v")
    assert [s.location.agent for s in merged.get("w").shards] == ["a", "b"]  # type: ignore[union-attr]
    assert set(merged.agents) == {"a", "b"} and merged.get("x") is None
    with pytest.raises(ValueError, match="same version"):
        merge_manifests([rank0, dataclasses.replace(rank1, version=4)])
    clash = Manifest(3, (), {"a": AgentRecord("a", b"other")})
    with pytest.raises(ValueError, match="differently"):
        merge_manifests([rank0, clash])
