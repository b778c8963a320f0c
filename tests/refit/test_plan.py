"""The planner against numpy ground truth, through the in-memory reference transport."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from refit_sidecar.core.manifest import (
    AgentRecord,
    Box,
    DType,
    Manifest,
    MemType,
    ParameterRecord,
    ShardLocation,
    ShardRecord,
)
from refit_sidecar.core.plan import (
    Checksums,
    PullPlan,
    UnsupportedRequest,
    Want,
    plan_pull,
    whole,
    with_checksums,
)
from refit_sidecar.integrity.checksum import ChecksumMismatch
from refit_sidecar.integrity.verify import verifies_every_read
from refit_sidecar.memory.region import Region
from refit_sidecar.publish.shard_specs import ShardSpec, split_pieces
from refit_sidecar.pull.transport import InMemoryTransport, SourceLost
from tests.refit.shards import in_memory_manifest, index, random_global, shard_of

Placed = list[tuple[str, ShardSpec, np.ndarray]]


def _publish(
    name: str,
    shape: tuple[int, ...],
    dim: int | None,
    parts: int,
    tp: int,
    *,
    dtype: DType = DType.FLOAT32,
    replicas: int = 1,
    seed: int = 0,
) -> tuple[np.ndarray, Placed]:
    """Global bytes of `name` and its shards, TP rank r of DP replica d on agent d{d}-tp{r}."""
    full = random_global(name, shape, dtype, seed)
    placed: Placed = []
    for d in range(replicas):
        for r in range(tp):
            local_shape, pieces = split_pieces(shape, dim, parts, r, tp)
            spec = ShardSpec(name, shape, dtype, local_shape, pieces)
            placed.append((f"d{d}-tp{r}", spec, shard_of(full, spec)))
    return full, placed


def _pull(manifest: Manifest, placed: Placed, wants: list[Want]) -> tuple[PullPlan, np.ndarray]:
    plan = plan_pull(manifest, wants)
    dest = np.zeros(plan.nbytes, np.uint8)
    buffers: dict[str, list[np.ndarray]] = {}
    for agent, _, buffer in placed:
        buffers.setdefault(agent, []).append(buffer)
    stats = InMemoryTransport(buffers).pull(plan, Region.of_array(dest), verify=True)
    assert stats.nbytes == sum(t.nbytes for t in plan.targets)  # every byte read once
    assert stats.verified_shards == sum(r.complete for r in plan.reads)
    return plan, dest


def _expect(plan: PullPlan, dest: np.ndarray, fulls: dict[str, np.ndarray]) -> None:
    for target in plan.targets:
        expected = fulls[target.name][index(target.box)]
        assert np.array_equal(dest[target.span], expected.reshape(-1)), target


def _random_box(rng: np.random.Generator, shape: tuple[int, ...]) -> Box:
    if rng.random() < 0.2:
        return Box.full(shape)
    ranges = []
    for n in shape:
        start = int(rng.integers(0, n))
        ranges.append((start, int(rng.integers(start + 1, n + 1))))
    return Box(tuple(ranges))


@pytest.mark.parametrize("seed", range(25))
def test_random_layouts_and_boxes_match_numpy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    fulls: dict[str, np.ndarray] = {}
    placed: Placed = []
    for p in range(int(rng.integers(1, 4))):
        ndim = int(rng.integers(1, 4))
        tp = int(rng.choice([1, 2, 4]))
        dim = None if rng.random() < 0.25 else int(rng.integers(0, ndim))
        parts = 1 if dim is None else int(rng.choice([1, 2]))
        shape = [int(rng.integers(1, 6)) for _ in range(ndim)]
        if dim is not None:
            shape[dim] = parts * tp * int(rng.integers(1, 4))
        dtype = DType(rng.choice([d.value for d in DType]))
        replicas = int(rng.integers(1, 3))
        name = f"p{p}"
        fulls[name], more = _publish(
            name, tuple(shape), dim, parts, tp, dtype=dtype, replicas=replicas, seed=seed
        )
        placed += more
    manifest = in_memory_manifest(seed, placed)
    wants = [
        Want(name, _random_box(rng, manifest.get(name).shape))  # type: ignore[union-attr]
        for name in rng.choice(sorted(fulls), size=int(rng.integers(1, 6)))
    ]
    plan, dest = _pull(manifest, placed, wants)
    _expect(plan, dest, fulls)
    plan, dest = _pull(manifest, placed, whole(manifest))
    _expect(plan, dest, fulls)
    assert all(r.complete for r in plan.reads)


def test_row_range_inside_one_shard_is_one_read() -> None:
    full, placed = _publish("w", (8, 6), dim=0, parts=1, tp=2)
    manifest = in_memory_manifest(1, placed)
    plan, dest = _pull(manifest, placed, [Want("w", Box(((5, 7), (0, 6))))])
    assert plan.num_reads == 1 and plan.reads[0].location.agent == "d0-tp1"
    assert not plan.reads[0].complete
    _expect(plan, dest, {"w": full})


def test_column_range_spanning_two_shards_reads_each_row_from_both() -> None:
    full, placed = _publish("w", (5, 8), dim=1, parts=1, tp=2)
    manifest = in_memory_manifest(1, placed)
    plan, dest = _pull(manifest, placed, [Want("w", Box(((1, 4), (2, 7))))])
    assert plan.num_reads == 3 * 2
    assert sorted(r.location.agent for r in plan.reads) == ["d0-tp0", "d0-tp1"]
    _expect(plan, dest, {"w": full})


def test_whole_fc1_reads_gate_and_up_pieces_of_each_rank() -> None:
    full, placed = _publish("fc1", (16, 3), dim=0, parts=2, tp=2)
    manifest = in_memory_manifest(1, placed)
    plan, dest = _pull(manifest, placed, whole(manifest))
    assert plan.num_reads == 4 and all(r.complete for r in plan.reads)
    _expect(plan, dest, {"fc1": full})
    # A TP=4 receiver's rank 1 wants gate rows 2:4 and up rows 10:12: one read each.
    wants = [Want("fc1", Box(((2, 4), (0, 3)))), Want("fc1", Box(((10, 12), (0, 3))))]
    plan, dest = _pull(manifest, placed, wants)
    assert plan.num_reads == 2
    _expect(plan, dest, {"fc1": full})


def test_replicas_are_read_once_and_spread_over_agents() -> None:
    placed: Placed = []
    fulls = {}
    for i in range(6):
        fulls[f"n{i}"], more = _publish(f"n{i}", (32,), None, 1, tp=2)
        placed += more
    manifest = in_memory_manifest(1, placed)
    plan, dest = _pull(manifest, placed, whole(manifest))
    _expect(plan, dest, fulls)
    assert sorted(r.location.agent for r in plan.reads) == ["d0-tp0"] * 3 + ["d0-tp1"] * 3


def test_strided_shard_layout() -> None:
    """A shard stored transposed (column-major) is read element by element, correctly."""
    full = random_global("t", (3, 4), DType.FLOAT16, 0)
    buffer = np.ascontiguousarray(full.transpose(1, 0, 2))
    location = ShardLocation(
        agent="a", address=buffer.ctypes.data, nbytes=buffer.nbytes, shape=(3, 4), strides=(1, 3)
    )
    _, pieces = split_pieces((3, 4), None, 1, 0, 1)
    record = ParameterRecord("t", (3, 4), DType.FLOAT16, (ShardRecord(location, pieces),))
    manifest = Manifest(1, (record,), {"a": AgentRecord("a", b"x")})
    plan, dest = _pull(
        manifest,
        [("a", ShardSpec("t", (3, 4), DType.FLOAT16, (3, 4), pieces), buffer)],
        [Want("t", Box(((1, 3), (1, 4))))],
    )
    assert plan.num_reads == 6
    _expect(plan, dest, {"t": full})


def test_requests_the_manifest_cannot_serve() -> None:
    _, placed = _publish("w", (8, 6), dim=0, parts=1, tp=2)
    manifest = in_memory_manifest(1, [p for p in placed if p[0] == "d0-tp0"])
    plan_pull(manifest, [Want("w", Box(((0, 4), (0, 6))))])
    with pytest.raises(UnsupportedRequest, match="no shard holds"):
        plan_pull(manifest, [Want("w", Box(((3, 5), (0, 6))))])
    with pytest.raises(UnsupportedRequest, match="outside"):
        plan_pull(manifest, [Want("w", Box(((0, 9), (0, 6))))])
    with pytest.raises(UnsupportedRequest, match="outside"):
        plan_pull(manifest, [Want("w", Box(((0, 1),)))])
    with pytest.raises(UnsupportedRequest, match="not in manifest"):
        plan_pull(manifest, [Want("nope", Box(((0, 1),)))])
    with pytest.raises(UnsupportedRequest):
        whole(manifest, ["nope"])


def test_checksums_catch_corruption_of_whole_shards_only() -> None:
    _, placed = _publish("w", (4, 6), dim=0, parts=1, tp=2)
    manifest = in_memory_manifest(1, placed)
    placed[1][2][0, 0, 0] ^= 1  # rank 1's shard changes after publication
    transport = InMemoryTransport({agent: [buffer] for agent, _, buffer in placed})
    partial = plan_pull(manifest, [Want("w", Box(((2, 3), (0, 6))))])
    assert (
        transport.pull(
            partial, Region.of_array(np.zeros(partial.nbytes, np.uint8)), verify=True
        ).verified_shards
        == 0
    )
    plan = plan_pull(manifest, whole(manifest))
    with pytest.raises(ChecksumMismatch, match="d0-tp1"):
        transport.pull(plan, Region.of_array(np.zeros(plan.nbytes, np.uint8)), verify=True)


def test_a_plan_is_checked_whole_only_when_every_read_is_a_whole_checksummed_shard() -> None:
    """`verifies_every_read`: what lets a fan-out child skip waiting for its parent's check."""
    _, placed = _publish("w", (4, 6), dim=0, parts=1, tp=2)
    manifest = in_memory_manifest(1, placed)
    host = Region.of_array(np.zeros(1, np.uint8))
    device = Region(1 << 20, 1, MemType.VRAM, 0)
    whole_plan = plan_pull(manifest, whole(manifest))
    assert verifies_every_read(whole_plan, host)  # CRC-32 on each whole shard
    assert not verifies_every_read(whole_plan, device)  # no WSUM-64 to check on a GPU
    with_sums = replace(whole_plan, reads=tuple(replace(r, sum64=7) for r in whole_plan.reads))
    assert verifies_every_read(with_sums, device)
    partial = plan_pull(manifest, [Want("w", Box(((2, 3), (0, 6))))])
    assert not verifies_every_read(partial, host)
    unsummed = replace(whole_plan, reads=tuple(replace(r, crc32=None) for r in whole_plan.reads))
    assert not verifies_every_read(unsummed, host)


def test_in_memory_transport_refuses_unregistered_memory() -> None:
    _, placed = _publish("w", (4, 6), dim=0, parts=1, tp=2)
    plan = plan_pull(in_memory_manifest(1, placed), [Want("w", Box(((0, 4), (0, 6))))])
    dest = Region.of_array(np.zeros(plan.nbytes, np.uint8))
    with pytest.raises(SourceLost):
        InMemoryTransport({"d0-tp0": [placed[0][2]]}).pull(plan, dest)
    with pytest.raises(SourceLost):
        InMemoryTransport({"d0-tp0": [placed[0][2]], "d0-tp1": [placed[0][2]]}).pull(plan, dest)
    with pytest.raises(ValueError, match="destination"):
        InMemoryTransport({}).pull(plan, Region.of_array(np.zeros(1, np.uint8)))


def test_a_plan_replayed_with_new_checksums_verifies_the_new_bytes() -> None:
    _, placed = _publish("w", (4, 6), dim=0, parts=1, tp=2)
    plan = plan_pull(in_memory_manifest(1, placed), whole(in_memory_manifest(1, placed)))
    placed[1][2][0, 0, 0] ^= 1  # the same slot, refreshed for version 2
    fresh = in_memory_manifest(2, placed)
    checksums = {r.name: tuple(Checksums(s.crc32) for s in r.shards) for r in fresh.parameters}
    replayed = with_checksums(plan, 2, checksums)
    assert replayed.version == 2 and replayed.targets == plan.targets
    transport = InMemoryTransport({agent: [buffer] for agent, _, buffer in placed})
    dest = np.zeros(plan.nbytes, np.uint8)
    assert transport.pull(replayed, Region.of_array(dest), verify=True).verified_shards == 2
    with pytest.raises(ChecksumMismatch):
        transport.pull(plan, Region.of_array(dest), verify=True)  # the old checksums
