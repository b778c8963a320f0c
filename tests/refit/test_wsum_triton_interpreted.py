"""The Triton kernel of WSUM-64 on the CPU, through Triton's interpreter: its block sums
against the reference, whole aligned blocks and masked ones, at the block size and at half and
twice it (as tests/gpu/test_wsum_gpu.py times it compiled on a GPU). Without this, the kernel
ran only on the GPU hosts.

The interpreter is chosen when a kernel is defined, so these tests run in a child pytest
with TRITON_INTERPRET=1; in the parent, one test starts it and checks its outcome."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from refit_sidecar.integrity import wsum

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
inside = pytest.mark.skipif(not INTERPRETED, reason="runs in the child with TRITON_INTERPRET=1")


def test_the_kernel_passes_under_the_interpreter() -> None:
    if INTERPRETED:
        pytest.skip("the child itself")
    pytest.importorskip("triton")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "4 passed, 1 skipped" in done.stdout, done.stdout[-2000:]


@inside
@pytest.mark.parametrize("block", [wsum.BLOCK // 2, wsum.BLOCK, wsum.BLOCK * 2])
def test_the_kernel_gives_the_reference_sums(block: int, monkeypatch) -> None:
    from refit_sidecar.integrity import device_sums as torch_wsum

    monkeypatch.setattr(wsum, "BLOCK", block)
    data = torch.from_numpy(np.random.default_rng(1).integers(0, 256, 200_000, dtype=np.uint8))
    # Whole aligned blocks, a shard starting off 16 bytes, one ending mid-block, one starting
    # inside its shard.
    offsets, lengths = [0, 70_002, 150_000], [65_536, 40_000, 46_000]
    plan = wsum.SumPlan.of(offsets, lengths, [0, 0, 128], [0, 1, 2], 3)
    blocks, groups, full = torch_wsum._tables(plan, data.device)
    assert 0 < full < len(blocks)  # both of the kernel's variants run
    kernel = torch_wsum._kernel()
    assert kernel is not None and "Interpreted" in type(kernel).__name__
    raw = data.numpy()
    expected = [
        wsum.wsum64(raw[0:65_536]),
        wsum.wsum64(raw[70_002:110_002]),
        wsum.wsum64(raw[150_000:196_000], 64),
    ]
    # group_sums takes the kernel for CUDA buffers only: its launches, on the CPU tensor.
    partial = torch.empty(len(blocks), dtype=torch.int64)
    units = data.view(torch.int16)
    torch_wsum._launch(kernel, units, blocks[:full], partial[:full], True)
    torch_wsum._launch(kernel, units, blocks[full:], partial[full:], False)
    sums = torch.zeros(3, dtype=torch.int64).index_add_(0, groups, partial)
    assert sums.numpy().view(np.uint64).tolist() == expected


@inside
def test_parted_sums_launch_the_kernel_over_runs_of_consecutive_parts() -> None:
    """`PartedSums.start(first, stop)`: every part's whole blocks, then every part's other
    blocks, as two runs of its table, summed by the kernel as the torch reference sums them
    part by part."""
    from refit_sidecar.core.manifest import MemType
    from refit_sidecar.integrity import device_sums as torch_wsum
    from tests.refit.test_running_check import LARGE, _pulled

    plan, _, region, _ = _pulled(MemType.VRAM, shapes=LARGE)
    parts = [[0, 1], [2, 3], [4, 5]]
    kernel = torch_wsum._kernel()
    assert kernel is not None
    together = torch_wsum.PartedSums(plan, region, parts)
    together._kernel = kernel  # on a CUDA buffer it would be chosen; here it runs interpreted
    together.start(0, 2)
    together.start(2, 3)
    reference = torch_wsum.PartedSums(plan, region, parts)
    for part in range(3):
        reference.start(part)
    assert torch.equal(together._partial, reference._partial)
    assert together.check() == reference.check() == len(LARGE)
