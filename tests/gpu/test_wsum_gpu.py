"""WSUM-64 on a GPU: the Triton kernel equals the reference and the torch path, a device slot
publishes it, a pull into device memory verifies it on the receiver's GPU, and a corrupted
byte in the published slot fails the pull. Run on a lent GPU machine:

    python -m pytest -m gpu tests/gpu -s
"""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
import torch

from refit_sidecar.core.manifest import DType, MemType
from refit_sidecar.core.plan import plan_pull, whole
from refit_sidecar.integrity import wsum
from refit_sidecar.integrity.checksum import ChecksumMismatch
from refit_sidecar.integrity.device_sums import _kernel, group_sums
from refit_sidecar.integrity.verify import verify_pulled
from refit_sidecar.memory.region import Region
from refit_sidecar.memory.tensor_arena import TorchArena
from refit_sidecar.publish.shard_source import ShardSource, SourceConfig
from refit_sidecar.publish.shard_specs import ShardSpec, split_pieces
from refit_sidecar.pull.nixl_transport import NixlConfig, NixlTransport
from tests.support.isolation import in_child_process

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _random(nbytes: int, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=generator)


def test_the_triton_kernel_equals_the_reference_and_the_torch_path() -> None:
    assert _kernel() is not None, "Triton must run here"
    buffer = _random(5 * wsum.BLOCK * 2 + 4_242, 1)
    host = buffer.cpu().numpy()
    # Whole blocks on 16 bytes (unmasked loads) and off them, partial blocks, an empty piece,
    # an index past 2**32.
    offsets = np.array([0, 20_000, 2, 40_000, 7_000, 100, 50_000, 6])
    lengths = np.array([2, 30_000, 4_000, 40_000, 0, 50, 31_000, 40_000])
    shard_offsets = np.array([0, 16_384, 2, 0, 30, 123_456, 1 << 40, 8])
    groups = np.array([0, 0, 1, 2, 1, 0, 3, 4])
    plan = wsum.SumPlan.of(offsets, lengths, shard_offsets, groups, 5)
    expected = plan.reference(host).tolist()
    assert group_sums(buffer, plan).tolist() == expected
    assert group_sums(buffer, plan, use_triton=False).tolist() == expected
    assert group_sums(buffer.cpu(), plan).tolist() == expected


def _median_s(run, repeats: int = 10) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


def test_the_kernel_sums_a_slot_at_hbm_speed(monkeypatch) -> None:
    """Not a timed assertion: the kernel's rate over 2.5 GB in 300 shards at the default block
    size and at half and twice it, printed for the record next to a device-local copy of the
    same bytes (what `wsum.BLOCK` was chosen by); the value is the torch path's at every block
    size (sums are exact in any cut)."""
    nbytes = 2_560 << 20
    buffer = _random(nbytes, 2)
    sizes = np.full(300, nbytes // 300 // 256 * 256)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    expected = None
    lines = []
    for block in (wsum.BLOCK // 2, wsum.BLOCK, wsum.BLOCK * 2):
        monkeypatch.setattr(wsum, "BLOCK", block)
        plan = wsum.SumPlan.of(offsets, sizes, np.zeros(300), np.arange(300), 300)
        got = group_sums(buffer, plan).tolist()
        expected = expected or group_sums(buffer, plan, use_triton=False).tolist()
        assert got == expected, block
        seconds = _median_s(lambda plan=plan: group_sums(buffer, plan))
        lines.append(f"{2 * block // 1024} KiB blocks {1e3 * seconds:.3f} ms "
                     f"({plan.nbytes / seconds / 1e12:.2f} TB/s)")  # fmt: skip
    copy = torch.empty_like(buffer)
    print(
        f"\nWSUM-64 of {nbytes / 2**30:.2f} GiB in 300 shards: {'; '.join(lines)}; "
        f"device-local copy {1e3 * _median_s(lambda: copy.copy_(buffer)):.3f} ms; "
        f"{torch.cuda.get_device_name()}"
    )


_SPECS = [
    ShardSpec(name, shape, dtype, *split_pieces(shape, None, 1, 0, 1))
    for name, shape, dtype in [
        ("decoder.layers.0.mlp.linear_fc1.weight", (512, 384), DType.BFLOAT16),
        ("decoder.layers.0.input_layernorm.weight", (384,), DType.FLOAT32),
        ("embedding.word_embeddings.weight", (1000, 384), DType.BFLOAT16),
    ]
]


@in_child_process
def test_a_vram_slot_is_verified_on_the_receivers_gpu_and_a_corrupted_byte_fails() -> None:
    source = ShardSource.create(
        SourceConfig(name="wsum-gpu-source"),
        _SPECS,
        functools.partial(TorchArena.allocate, device=torch.device("cuda", 0)),
    )
    transport = NixlTransport.create(NixlConfig(name="wsum-gpu-puller", pull_timeout_s=60))
    try:
        arena = source.arena
        assert isinstance(arena, TorchArena) and arena.mem_type is MemType.VRAM
        arena.tensor.copy_(_random(arena.nbytes, 3))
        manifest = source.manifest(1, checksums=True)
        host = arena.tensor.cpu().numpy()
        for record in manifest.parameters:
            (shard,) = record.shards
            start = source.offset(record.name)
            assert shard.crc32 is None
            assert shard.sum64 == wsum.wsum64(host[start : start + shard.location.nbytes])
        plan = plan_pull(manifest, whole(manifest))
        staging = TorchArena.allocate(plan.nbytes, 256, device=torch.device("cuda", 0))
        region = Region(staging.address, staging.nbytes, staging.mem_type, 0, owner=staging)
        assert transport.pull(plan, region, verify=True).verified_shards == len(_SPECS)
        for target in plan.targets:
            start = source.offset(target.name)
            assert torch.equal(
                staging.tensor[target.span], arena.tensor[start : start + target.nbytes]
            )
        target = plan.targets[-1]
        arena.tensor[source.offset(target.name) + 1001] ^= 0x01
        with pytest.raises(ChecksumMismatch, match=f"{target.name} shard 0 .*wsum64"):
            transport.pull(plan, region, verify=True)
        with pytest.raises(ChecksumMismatch):
            verify_pulled(plan, region)
    finally:
        transport.close()
        source.close()


@in_child_process
def test_warm_up_compiles_both_kernel_variants_so_the_first_check_compiles_nothing() -> None:
    """After `warm_up` (a receiver's start) the kernel holds its whole-block and masked
    variants for the device, and the first sums over a buffer of another size compile none
    (Triton's per-device cache of compiled variants does not grow); they equal the host's."""
    from refit_sidecar.integrity.device_sums import warm_up

    kernel = _kernel()

    def compiled() -> int:
        return sum(len(caches[0]) for caches in kernel.device_caches.values())

    assert compiled() == 0
    warm_up(torch.device("cuda"))
    variants = compiled()
    assert variants >= 2
    data = _random(3 * wsum.BLOCK * wsum.UNIT + 10, seed=5)
    plan = wsum.SumPlan.of([0], [data.numel()], [0], [0], 1)
    assert np.array_equal(group_sums(data, plan), plan.reference(data.cpu().numpy()))
    assert compiled() == variants
