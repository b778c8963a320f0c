"""WSUM-64 (refit_sidecar/integrity/wsum.py): the reference's properties, the torch
implementation held to it on the CPU (the Triton kernel is held to it by tests/gpu), a torch arena's
device checksums, and pulls verified by it, host and device staging alike."""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch

from refit_sidecar.core.manifest import DType
from refit_sidecar.core.plan import plan_pull, whole
from refit_sidecar.integrity import wsum
from refit_sidecar.integrity.checksum import ChecksumMismatch
from refit_sidecar.integrity.device_sums import group_sums, verify_device
from refit_sidecar.integrity.verify import verify_pulled
from refit_sidecar.memory.region import Region
from refit_sidecar.memory.tensor_arena import TorchArena
from refit_sidecar.publish.shard_source import ShardSource, SourceConfig
from refit_sidecar.publish.shard_specs import ShardSpec, split_pieces
from refit_sidecar.pull.nixl_transport import NixlConfig, NixlTransport
from tests.support.isolation import in_child_process

_RNG = np.random.default_rng(7)


def _bytes(n: int) -> np.ndarray:
    return _RNG.integers(0, 256, n, dtype=np.uint8)


def test_the_reference_is_pinned_by_its_definition() -> None:
    """Three units computed by hand from the module's formula (Python integers), so the
    vectorised reference cannot drift from the specification."""

    def weight(j: int) -> int:
        z = (j & wsum.MASK32) ^ (((j >> 32) * wsum.FOLD) & wsum.MASK32)
        z = ((z + wsum.SEED) * wsum.K1) & wsum.MASK32
        z ^= z >> wsum.SHIFT1
        z = (z * wsum.K2) & wsum.MASK32
        z ^= z >> wsum.SHIFT2
        return z | 1

    data = bytes([0x34, 0x12, 0xFF, 0xFF, 0x00, 0x80])  # units 0x1234, 0xFFFF, 0x8000
    expected = sum(u * weight(j) for j, u in enumerate([0x1234, 0xFFFF, 0x8000])) & wsum.MASK64
    assert wsum.wsum64(data) == expected
    assert wsum.wsum64(data[2:], 1) == (expected - 0x1234 * weight(0)) & wsum.MASK64
    assert wsum.wsum64(data[:2], 5 << 32) == 0x1234 * weight(5 << 32)  # high index bits count
    assert weight(5 << 32) != weight(0)
    with pytest.raises(ValueError, match="even"):
        wsum.wsum64(b"abc")


def test_pieces_at_their_shard_offsets_add_up_to_the_whole() -> None:
    data = _bytes(2 * 50_001)
    whole_sum = wsum.wsum64(data)
    cuts = [0, 2, 998, 40_000, 100_002]
    parts = [wsum.wsum64(data[a:b], a // 2) for a, b in itertools.pairwise(cuts)]
    assert sum(parts) & wsum.MASK64 == whole_sum


def test_every_single_byte_change_and_a_swap_are_detected() -> None:
    data = _bytes(4096)
    base = wsum.wsum64(data)
    for position in range(0, data.size, 7):
        for flip in (1, 0x80, 0xFF):
            changed = data.copy()
            changed[position] ^= flip
            assert wsum.wsum64(changed) != base, (position, flip)
    swapped = data.copy()
    swapped[[10, 11, 500, 501]] = data[[500, 501, 10, 11]]
    assert (data[10:12] != data[500:502]).any() and wsum.wsum64(swapped) != base


def test_the_torch_implementation_equals_the_reference() -> None:
    buffer = _bytes(3 * wsum.BLOCK * 2 + 1234)
    # Pieces of three shards, out of order, across block boundaries, one of them empty.
    offsets = np.array([0, 20_000, 2, 40_000, 7_000, 100])
    lengths = np.array([2, 30_000, 4_000, 9_000, 0, 50])
    shard_offsets = np.array([0, 16_384, 2, 0, 30, 123_456])
    groups = np.array([0, 0, 1, 2, 1, 0])
    plan = wsum.SumPlan.of(offsets, lengths, shard_offsets, groups, 3)
    assert plan.nbytes == int(lengths.sum())
    expected = [0, 0, 0]
    for o, n, s, g in zip(offsets, lengths, shard_offsets, groups, strict=True):
        expected[g] += wsum.wsum64(buffer[o : o + n], s // 2)
    expected = [e & wsum.MASK64 for e in expected]
    assert plan.reference(buffer).tolist() == expected
    got = group_sums(torch.from_numpy(buffer.copy()), plan)
    assert got.dtype == np.uint64 and got.tolist() == expected
    with pytest.raises(ValueError, match="even"):
        wsum.SumPlan.of([1], [2], [0], [0], 1)
    with pytest.raises(ValueError, match="outside"):
        group_sums(torch.zeros(8, dtype=torch.uint8), wsum.SumPlan.of([4], [8], [0], [0], 1))


def test_the_host_implementation_equals_the_reference() -> None:
    """Whole passes, a partial last pass, unaligned starts, indices past 2**32, bytes."""
    buffer = _bytes(3 * (1 << 17) + 1234)
    for start_byte, length, start_unit in [
        (0, len(buffer) - len(buffer) % 2, 0),
        (6, 2 * (1 << 16), 5),
        (1, 1000, 0),
        (0, 4096, (1 << 32) - 1000),
        (0, 4096, (1 << 32) - 2048),  # ends at 2**32: the 32-bit path's last indices
        (2, 3 * (1 << 16), 5 << 32),
        (10, 0, 7),
    ]:
        data = buffer[start_byte : start_byte + length]
        assert wsum.host_wsum64(data, start_unit) == wsum.wsum64(data, start_unit)
    assert wsum.host_wsum64(buffer[:64].tobytes()) == wsum.wsum64(buffer[:64])
    with pytest.raises(ValueError, match="even"):
        wsum.host_wsum64(buffer[:3])


_SPECS = [
    ShardSpec(name, shape, dtype, *split_pieces(shape, None, 1, 0, 1))
    for name, shape, dtype in [
        ("decoder.layers.0.mlp.linear_fc1.weight", (48, 40), DType.BFLOAT16),
        ("decoder.layers.0.input_layernorm.weight", (40,), DType.FLOAT32),
        ("embedding.word_embeddings.weight", (9, 40), DType.BFLOAT16),
    ]
]


@in_child_process
def test_a_torch_arena_publishes_wsums_that_a_pull_verifies_and_corruption_fails() -> None:
    """A torch arena (on the CPU here, a GPU's in tests/gpu) publishes each shard's WSUM-64;
    a pull into host memory and one into a torch tensor both verify them, and one flipped
    byte in the source fails both, naming the shard."""
    source = ShardSource.create(
        SourceConfig(name="wsum-source"),
        _SPECS,
        functools.partial(TorchArena.allocate, device=torch.device("cpu")),
    )
    transport = NixlTransport.create(NixlConfig(name="wsum-puller", pull_timeout_s=60))
    try:
        arena = source.arena
        assert isinstance(arena, TorchArena)
        arena.tensor.copy_(torch.from_numpy(_bytes(arena.nbytes)))
        manifest = source.manifest(1, checksums=False)
        # As a device slot publishes: a WSUM-64 per shard, no CRC-32.
        sums = source.device_sums()
        parameters = tuple(
            replace(r, shards=(replace(r.shards[0], sum64=value),))
            for r, value in zip(manifest.parameters, sums, strict=True)
        )
        manifest = replace(manifest, parameters=parameters)
        for record in manifest.parameters:
            (shard,) = record.shards
            start = source.offset(record.name)
            raw = arena.tensor[start : start + shard.location.nbytes].numpy()
            assert shard.crc32 is None and shard.sum64 == wsum.wsum64(raw)
        plan = plan_pull(manifest, whole(manifest))
        host = np.zeros(plan.nbytes, np.uint8)
        assert transport.pull(plan, Region.of_array(host), verify=True).verified_shards == 3
        staging = torch.zeros(plan.nbytes, dtype=torch.uint8)
        region = Region(staging.data_ptr(), staging.numel(), owner=staging)
        transport.pull(plan, region)
        assert verify_device(plan, region) == 3 and verify_pulled(plan, region) == 3
        target = plan.targets[0]
        arena.tensor[source.offset(target.name) + 17] ^= 0x10
        with pytest.raises(ChecksumMismatch, match=f"{target.name} shard 0 .*wsum64"):
            transport.pull(plan, Region.of_array(host), verify=True)
        transport.pull(plan, region)
        with pytest.raises(ChecksumMismatch, match=f"{target.name} shard 0 .*wsum64"):
            verify_device(plan, region)
    finally:
        transport.close()
        source.close()
