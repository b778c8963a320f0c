"""The Triton kernels of WSUM-64 on the CPU, through Triton's interpreter: the block sums
against the reference, and `CopySum` (a snapshot's copy summed in the same pass) against a
plain copy and the reference sums, whole aligned blocks and the masked ones, pieces cutting
shards, and padding between shards copied but not summed. The GPU runs the same kernels
compiled (tests/gpu/test_wsum_gpu.py, tests/gpu/test_publication_gpu.py).

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

from refit_sidecar import wsum

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
inside = pytest.mark.skipif(not INTERPRETED, reason="runs in the child with TRITON_INTERPRET=1")


def test_the_kernels_pass_under_the_interpreter() -> None:
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


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


@inside
def test_the_block_kernel_gives_the_reference_sums() -> None:
    from refit_sidecar import torch_wsum

    data = _bytes(6 * wsum.BLOCK * wsum.UNIT + 1000, 1)
    # Whole aligned blocks, a shard starting off 16 bytes, and one ending mid-block.
    offsets, lengths = [0, 70_002, 150_000], [65_536, 40_000, 46_000]
    plan = wsum.SumPlan.of(offsets, lengths, [0, 0, 128], [0, 1, 2], 3)
    blocks, groups, full = torch_wsum._tables(plan, data.device)
    assert 0 < full < len(blocks)  # both variants of the kernel run
    partial = torch.empty(len(blocks), dtype=torch.int64)
    kernel = torch_wsum._kernel()
    units = data.view(torch.int16)
    torch_wsum._launch(kernel, units, blocks[:full], partial[:full], True)
    torch_wsum._launch(kernel, units, blocks[full:], partial[full:], False)
    sums = torch.zeros(3, dtype=torch.int64).index_add_(0, groups, partial)
    raw = data.numpy()
    expected = [
        wsum.wsum64(raw[0:65_536]),
        wsum.wsum64(raw[70_002:110_002]),
        wsum.wsum64(raw[150_000:196_000], 64),
    ]
    assert sums.numpy().view(np.uint64).tolist() == expected


def _slot() -> tuple[torch.Tensor, list[list[tuple[torch.Tensor, torch.Tensor]]], list, list]:
    """Two source buffers laid into a slot as two regions (the second 2 bytes off 16-byte
    alignment in its buffer), cut into three pieces, one end inside a shard; shards with
    padding between them. Returns the slot, its pieces, the shards (offset, bytes) and the
    sources of the regions."""
    first, second = _bytes(200_000, 2), _bytes(90_000, 3)
    slot = torch.zeros(300_032, dtype=torch.uint8)
    regions = [  # (source, start in it, bytes, offset in the slot)
        (first, 0, 200_000, 0),
        (second, 2, 89_998, 200_192),
    ]
    ends = [100_000, 250_000, 300_032]  # the piece ends: 100_000 cuts a shard
    pieces: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in ends]
    for source, start, n, offset in regions:
        at = offset
        while at < offset + n:
            piece = next(i for i, end in enumerate(ends) if at < end)
            upto = min(offset + n, ends[piece])
            s = start + at - offset
            pieces[piece].append((slot[at:upto], source[s : s + upto - at]))
            at = upto
    shards = [  # (offset in the slot, bytes); 4 bytes of padding after the first
        (0, 70_000),
        (70_004, 129_996),
        (200_192, 60_000),
        (260_192, 29_998),
    ]
    return slot, pieces, shards, regions


@inside
def test_copy_sum_copies_every_byte_and_sums_each_shard() -> None:
    from refit_sidecar.copy_sum import CopySum

    slot, pieces, shards, regions = _slot()
    fused = CopySum.create(slot, pieces, shards)
    assert fused is not None and fused.pieces == 3
    for piece in range(fused.pieces):
        fused.copy(piece)
    sums = fused.sums().numpy().view(np.uint64).tolist()
    for source, start, n, offset in regions:  # the padding between shards copied too
        assert torch.equal(slot[offset : offset + n], source[start : start + n])
    raw = slot.numpy()
    assert sums == [wsum.wsum64(raw[o : o + n]) for o, n in shards]
    # A second version: new bytes in the sources give new sums (the partial sums are
    # rewritten, not added to).
    for source, *_ in regions:
        source.add_(1)
    for piece in range(fused.pieces):
        fused.copy(piece)
    again = fused.sums().numpy().view(np.uint64).tolist()
    assert again == [wsum.wsum64(slot.numpy()[o : o + n]) for o, n in shards] != sums


@inside
def test_copy_sum_declines_parts_on_odd_bytes() -> None:
    from refit_sidecar.copy_sum import CopySum

    slot, source = torch.zeros(64, dtype=torch.uint8), _bytes(64, 4)
    assert CopySum.create(slot, [[(slot[0:31], source[1:32])]], [(0, 30)]) is None
    assert CopySum.create(slot, [[(slot[0:32], source[0:32])]], [(0, 32)]) is not None


@inside
def test_the_segments_of_a_part_follow_the_shards() -> None:
    from refit_sidecar.copy_sum import _segments

    shards = [(0, 10, 1), (14, 6, 0), (30, 10, 2)]
    starts = [0, 14, 30]
    assert _segments(4, 36, shards, starts) == [
        (4, 6, 4, 1),
        (10, 4, 0, -1),
        (14, 6, 0, 0),
        (20, 10, 0, -1),
        (30, 6, 0, 2),
    ]
