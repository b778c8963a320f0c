"""A receiver's staged copy read as a source (`tests.support.peer`): other receivers, of
another TP layout, plan and pull from it with the same planner and get the trainer's bytes, bit
for bit, checksums verified; mixed with the trainer's shards the reads spread over both."""

from __future__ import annotations

import numpy as np
import pytest

from refit_sidecar.core.manifest import AgentRecord, Box, DType, Manifest
from refit_sidecar.core.plan import PullPlan, UnsupportedRequest, Want, plan_pull
from refit_sidecar.integrity.checksum import ChecksumMismatch, checksum
from refit_sidecar.memory.region import Region
from refit_sidecar.publish.shard_specs import ShardSpec, split_pieces
from refit_sidecar.pull.transport import InMemoryTransport
from tests.refit.shards import in_memory_manifest, index, random_global, shard_of
from tests.support.peer import staged_manifest, with_peers

PARAMS = {  # name: (global shape, TP split dim, parts)
    "decoder.layers.0.self_attention.linear_qkv.weight": ((48, 16), 0, 1),
    "decoder.layers.0.mlp.linear_fc1.weight": ((64, 16), 0, 2),  # [gate; up] per rank
    "decoder.layers.0.mlp.linear_fc2.weight": ((16, 32), 1, 1),
    "decoder.final_layernorm.weight": ((16,), None, 1),
}


def _trainer(tp: int = 2) -> tuple[dict[str, np.ndarray], list, Manifest]:
    fulls, placed = {}, []
    for i, (name, (shape, dim, parts)) in enumerate(PARAMS.items()):
        fulls[name] = full = random_global(name, shape, DType.FLOAT32, seed=i)
        for r in range(tp):
            local_shape, pieces = split_pieces(shape, dim, parts, r, tp)
            spec = ShardSpec(name, shape, DType.FLOAT32, local_shape, pieces)
            placed.append((f"trainer-rank{r}", spec, shard_of(full, spec)))
    return fulls, placed, in_memory_manifest(3, placed)


def _rows(name: str, rank: int, tp: int) -> Box:
    """Rank `rank` of `tp`'s rows of `name` (the whole of a 1-D tensor)."""
    shape = PARAMS[name][0]
    if len(shape) == 1:
        return Box.full(shape)
    rows = shape[0] // tp
    return Box(((rank * rows, (rank + 1) * rows), (0, shape[1])))


def _pull(manifest: Manifest, buffers: dict, wants: list[Want]) -> tuple[PullPlan, np.ndarray]:
    plan = plan_pull(manifest, wants)
    dest = np.zeros(plan.nbytes, np.uint8)
    InMemoryTransport(buffers).pull(plan, Region.of_array(dest), verify=True)
    return plan, dest


def _check(plan: PullPlan, dest: np.ndarray, fulls: dict[str, np.ndarray]) -> None:
    for target in plan.targets:
        expected = fulls[target.name][index(target.box)].reshape(-1).view(np.uint8)
        assert np.array_equal(dest[target.span], expected), target.name


def _peer(plan: PullPlan, dest: np.ndarray, manifest: Manifest, name: str) -> Manifest:
    shapes = {p.name: p.shape for p in manifest.parameters}
    sums = [checksum(dest[t.span]) for t in plan.targets]
    agent = AgentRecord(name, metadata=b"in-memory")
    return staged_manifest(plan, shapes, agent=agent, address=dest.ctypes.data, checksums=sums)


def test_a_receiver_of_another_layout_pulls_from_a_peer_bit_for_bit() -> None:
    fulls, placed, trainer = _trainer()
    buffers: dict[str, list[np.ndarray]] = {}
    for agent, _, buffer in placed:
        buffers.setdefault(agent, []).append(buffer)
    # Receiver A (TP=2 rank 1) pulls its rows from the trainer...
    wants_a = [Want(n, _rows(n, 1, 2)) for n in PARAMS]
    plan_a, staged_a = _pull(trainer, buffers, wants_a)
    _check(plan_a, staged_a, fulls)
    peer = _peer(plan_a, staged_a, trainer, "receiver-a")
    # ... and receiver B (TP=4 rank 3, rows inside A's) pulls from A alone.
    wants_b = [Want(n, _rows(n, 3, 4)) for n in PARAMS]
    plan_b, dest_b = _pull(peer, {"receiver-a": [staged_a]}, wants_b)
    _check(plan_b, dest_b, fulls)
    assert set(plan_b.agents) == {"receiver-a"}
    # A whole box of A's (the layer norm) is read whole: its checksum is verified.
    norm = next(r for r in plan_b.reads if r.parameter == "decoder.final_layernorm.weight")
    assert norm.complete and norm.crc32 is not None
    # Rows A does not hold are not served by A.
    with pytest.raises(UnsupportedRequest):
        plan_pull(peer, [Want(n, _rows(n, 0, 4)) for n in PARAMS])


def test_a_corrupted_peer_copy_fails_verification() -> None:
    _, placed, trainer = _trainer()
    buffers: dict[str, list[np.ndarray]] = {}
    for agent, _, buffer in placed:
        buffers.setdefault(agent, []).append(buffer)
    plan_a, staged_a = _pull(trainer, buffers, [Want(n, _rows(n, 0, 2)) for n in PARAMS])
    peer = _peer(plan_a, staged_a, trainer, "receiver-a")
    staged_a[plan_a.targets[-1].offset] ^= 0xFF  # the layer norm's first byte
    with pytest.raises(ChecksumMismatch, match="from receiver-a: crc32"):
        _pull(peer, {"receiver-a": [staged_a]}, [Want(n, _rows(n, 0, 2)) for n in PARAMS])


def test_with_peers_spreads_reads_over_the_trainer_and_the_peer() -> None:
    fulls, placed, trainer = _trainer()
    buffers: dict[str, list[np.ndarray]] = {}
    for agent, _, buffer in placed:
        buffers.setdefault(agent, []).append(buffer)
    whole = [Want(n, Box.full(PARAMS[n][0])) for n in PARAMS]
    plan_a, staged_a = _pull(trainer, buffers, whole)
    peer = _peer(plan_a, staged_a, trainer, "receiver-a")
    mixed = with_peers(trainer, [peer])
    plan_b, dest_b = _pull(mixed, {**buffers, "receiver-a": [staged_a]}, whole)
    _check(plan_b, dest_b, fulls)
    by_agent: dict[str, int] = {}
    for reads in plan_b.reads:
        by_agent[reads.location.agent] = by_agent.get(reads.location.agent, 0) + reads.nbytes
    assert "receiver-a" in by_agent and len(by_agent) > 1, by_agent


def test_a_peer_of_another_version_or_shape_is_refused() -> None:
    _, _, trainer = _trainer()
    plan = plan_pull(trainer, [Want(n, Box.full(PARAMS[n][0])) for n in PARAMS])
    shapes = {p.name: p.shape for p in trainer.parameters}
    agent = AgentRecord("receiver-a", metadata=b"m")
    peer = staged_manifest(plan, shapes, agent=agent, address=1 << 20)
    with pytest.raises(ValueError, match="a peer of version"):
        with_peers(Manifest(4, trainer.parameters, trainer.agents), [peer])
    with pytest.raises(ValueError, match="checksums for"):
        staged_manifest(plan, shapes, agent=agent, address=1 << 20, checksums=[1])
    with pytest.raises(ValueError, match="no global shape"):
        staged_manifest(plan, {}, agent=agent, address=1 << 20)
