"""Snapshot arenas: host (numpy) and torch arenas, the memory type a device maps to, and what a
source built on each publishes. The CUDA arena runs the torch arena's code on a GPU; here the
same code runs against CPU memory, and a device arena's manifest is checked with a stand-in."""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from refit_sidecar.core.manifest import AgentRecord, DType, MemType
from refit_sidecar.core.plan import plan_pull, whole
from refit_sidecar.memory.host_arena import HostArena
from refit_sidecar.memory.region import Region
from refit_sidecar.memory.tensor_arena import TorchArena, memory_of
from refit_sidecar.publish.shard_source import ShardSource, SourceConfig, arena_offsets
from refit_sidecar.publish.shard_specs import ShardSpec, split_pieces
from refit_sidecar.pull.nixl_transport import NixlConfig, NixlTransport
from tests.support.isolation import in_child_process

SPECS = [
    ShardSpec(name, shape, dtype, *split_pieces(shape, None, 1, 0, 1))
    for name, shape, dtype in [
        ("decoder.layers.0.mlp.linear_fc2.weight", (24, 33), DType.BFLOAT16),
        ("decoder.layers.0.input_layernorm.weight", (5,), DType.FLOAT32),
        ("embedding.word_embeddings.weight", (7, 3), DType.FLOAT16),
    ]
]
_TORCH = {
    DType.BFLOAT16: torch.bfloat16,
    DType.FLOAT32: torch.float32,
    DType.FLOAT16: torch.float16,
}


def test_memory_types_follow_the_device():
    assert memory_of(torch.device("cpu")) == (MemType.DRAM, 0)
    assert memory_of(torch.device("cuda", 1)) == (MemType.VRAM, 1)
    with pytest.raises(ValueError):
        memory_of(torch.device("meta"))


@pytest.mark.parametrize(
    "allocate",
    [HostArena.allocate, functools.partial(TorchArena.allocate, device=torch.device("cpu"))],
    ids=["host", "torch-cpu"],
)
def test_arenas_are_aligned_zeroed_host_memory_on_the_cpu(allocate):
    arena = allocate(1000, 512)
    assert (arena.nbytes, arena.address % 512) == (1000, 0)
    assert (arena.mem_type, arena.device_id) == (MemType.DRAM, 0)
    view = arena.host_view(100, 10)
    assert view.nbytes == 10 and not view.any()
    view[:] = 7
    assert arena.host_view(0, 1000).sum() == 70


def test_torch_arena_views_are_typed_windows_of_the_arena():
    offsets, size = arena_offsets(SPECS, 256)
    assert list(offsets.values()) == [0, 1792, 2048] and size == 2304
    arena = TorchArena.allocate(size, 256, device=torch.device("cpu"))
    for spec in SPECS:
        view = arena.tensor_view(offsets[spec.parameter], _TORCH[spec.dtype], spec.local_shape)
        value = torch.arange(view.numel(), dtype=torch.float32).reshape(view.shape)
        view.copy_(value)
        expected = value.to(view.dtype).view(torch.uint8).reshape(-1).numpy()
        assert np.array_equal(arena.host_view(offsets[spec.parameter], spec.nbytes), expected)
    with pytest.raises(ValueError):
        arena.tensor_view(1, torch.float32, (2,))  # misaligned for the dtype
    with pytest.raises(ValueError):
        arena.tensor_view(size - 4, torch.float32, (2,))  # past the end
    with pytest.raises(ValueError):
        TorchArena(torch.zeros(8, dtype=torch.float32))


@dataclass
class _DeviceArena:
    """Stands in for a TorchArena on cuda:1 (what its manifest needs: no memory behind it)."""

    address: int = 1 << 40
    nbytes: int = 2304
    mem_type: MemType = MemType.VRAM
    device_id: int = 1

    def host_view(self, start: int, nbytes: int) -> np.ndarray:
        raise ValueError("device memory has no host view")


class _Agent:
    config = SourceConfig(name="rank0-slot0")

    def record(self) -> AgentRecord:
        return AgentRecord("rank0-slot0", b"agent-metadata", "", None, 0)


def test_a_device_source_publishes_device_locations_without_checksums():
    offsets, _ = arena_offsets(SPECS, 256)
    source = ShardSource(
        config=SourceConfig(name="rank0-slot0"),
        agent=_Agent(),  # type: ignore[arg-type]
        arena=_DeviceArena(),
        specs={s.parameter: s for s in SPECS},
        offsets=offsets,
        registration=None,
    )
    manifest = source.manifest(3)
    for record in manifest.parameters:
        (shard,) = record.shards
        assert (shard.location.mem_type, shard.location.device_id) == (MemType.VRAM, 1)
        assert shard.location.address == (1 << 40) + offsets[record.name]
        assert shard.crc32 is None
    with pytest.raises(ValueError):
        source.manifest(3, checksums=True)
    with pytest.raises(ValueError):
        source.view(SPECS[0].parameter)


@in_child_process
def test_a_torch_arena_source_serves_nixl_pulls_with_checksums():
    source = ShardSource.create(
        SourceConfig(name="torch-arena-source"),
        SPECS,
        functools.partial(TorchArena.allocate, device=torch.device("cpu")),
    )
    transport = NixlTransport.create(NixlConfig(name="torch-arena-puller", pull_timeout_s=60))
    try:
        arena = source.arena
        assert isinstance(arena, TorchArena)
        written = {}
        for i, spec in enumerate(SPECS):
            view = arena.tensor_view(source.offset(spec.parameter), _TORCH[spec.dtype], spec.shape)
            view.copy_(torch.randn(spec.shape, generator=torch.Generator().manual_seed(i)))
            written[spec.parameter] = view.view(torch.uint8).reshape(-1).numpy().copy()
        manifest = source.manifest(1)
        for record in manifest.parameters:
            assert record.shards[0].crc32 == zlib.crc32(written[record.name].data)
        plan = plan_pull(manifest, whole(manifest))
        dest = np.zeros(plan.nbytes, np.uint8)
        stats = transport.pull(plan, Region.of_array(dest), verify=True)
        assert stats.verified_shards == len(SPECS)
        for target in plan.targets:
            assert np.array_equal(dest[target.span], written[target.name])
    finally:
        transport.close()
        source.close()
