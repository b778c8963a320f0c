"""`running_check.RunningCheck`: a pull's shards checked as the destination fills in order, the
device path run here on a CPU tensor (tests/gpu runs it on a GPU through the fan-out)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import pytest
import torch

from refit_sidecar.core.manifest import Box, DType, MemType, ShardPiece
from refit_sidecar.core.plan import Checksums, PullPlan, plan_pull, whole, with_read_checksums
from refit_sidecar.integrity import wsum
from refit_sidecar.integrity.checksum import ChecksumMismatch
from refit_sidecar.integrity.device_sums import PartedSums
from refit_sidecar.memory.region import Region
from refit_sidecar.publish.shard_specs import ShardSpec
from refit_sidecar.pull.chunking import chunk_bounds
from refit_sidecar.pull.running_check import RunningCheck
from refit_sidecar.pull.transport import InMemoryTransport
from tests.refit.shards import in_memory_manifest

SHAPES = [(64, 32), (16,), (128, 32), (8, 32), (96, 32), (40,)]


def _pulled(
    mem_type: MemType,
    device: str = "cpu",
    shapes: Sequence[tuple[int, ...]] = SHAPES,
    checksum: Callable[[np.ndarray], int] = wsum.wsum64,
) -> tuple[PullPlan, torch.Tensor, Region, list[np.ndarray]]:
    """Whole tensors of `shapes` (six small ones) of one trainer rank, each shard with its
    WSUM-64 (`checksum`), pulled into a tensor on `device` described as `mem_type` memory."""
    rng = np.random.default_rng(7)
    placed = []
    for i, shape in enumerate(shapes):
        buffer = np.frombuffer(rng.bytes(int(np.prod(shape)) * 2), np.uint8).copy()
        spec = ShardSpec(
            f"t{i}", shape, DType.BFLOAT16, shape, (ShardPiece(Box.full(shape), (0,) * len(shape)),)
        )
        placed.append(("rank-0", spec, buffer))
    manifest = in_memory_manifest(1, placed)
    manifest = replace(
        manifest,
        parameters=tuple(
            replace(p, shards=(replace(p.shards[0], crc32=None, sum64=checksum(b)),))
            for p, (_, _, b) in zip(manifest.parameters, placed, strict=True)
        ),
    )
    plan = plan_pull(manifest, whole(manifest))
    pulled = torch.zeros(plan.nbytes, dtype=torch.uint8)
    host = Region(pulled.data_ptr(), pulled.numel(), owner=pulled)
    InMemoryTransport({"rank-0": [b for _, _, b in placed]}).pull(plan, host)
    staging = pulled.to(device)
    region = Region(staging.data_ptr(), staging.numel(), mem_type, 0, owner=staging)
    return plan, staging, region, [b for _, _, b in placed]


def _end(plan: PullPlan, i: int) -> int:
    reads = plan.reads[i]
    return int((reads.dest_offsets + reads.lengths).max())


def _sizes(plan: PullPlan) -> list[tuple[int, int]]:
    """(end, bytes) of each read, in the order they end."""
    return sorted((_end(plan, i), int(plan.reads[i].lengths.sum())) for i in range(len(plan.reads)))


def test_parts_start_as_the_destination_fills_and_finish_checks_every_shard() -> None:
    plan, _, region, _ = _pulled(MemType.VRAM)
    check = RunningCheck(plan, region, part_bytes=1)  # a part per shard
    ends = [end for end, _ in _sizes(plan)]
    check.advance(ends[0] - 1)
    assert check.started == 0  # no shard lies whole before the prefix yet
    check.advance(ends[2])
    assert check.started == 3
    check.advance(ends[2])  # the same prefix again starts nothing more
    assert check.started == 3
    assert check.finish() == len(SHAPES) and check.started == len(SHAPES)


def test_parts_hold_their_bytes_and_are_cut_from_the_layout_alone() -> None:
    """Consecutive shards until a part holds `part_bytes`; the same for every pull of the
    layout, however the prefix grew (so each part's tables are reused)."""
    plan, _, region, _ = _pulled(MemType.VRAM)
    sizes = _sizes(plan)
    part = sizes[0][1] + sizes[1][1]  # the first two shards' bytes
    assert sizes[2][1] >= part > sizes[3][1] and sizes[3][1] + sizes[4][1] >= part
    # Two shards, one, two, and the last one, which holds less.
    expected_ends = [sizes[1][0], sizes[2][0], sizes[4][0], sizes[5][0]]
    for prefixes in ([plan.nbytes], [sizes[0][0], sizes[3][0], plan.nbytes]):
        check = RunningCheck(plan, region, part_bytes=part)
        for prefix in prefixes:
            check.advance(prefix)
        assert [p.end for p in check._cut()] == expected_ends
        assert check.started == 4
        assert check.finish() == len(SHAPES)
    check = RunningCheck(plan, region, part_bytes=part)
    check.advance(sizes[1][0] - 1)
    assert check.started == 0  # the first part's second shard is not whole yet
    check.advance(sizes[1][0])
    assert check.started == 1


def test_tapered_parts_halve_towards_the_end() -> None:
    """With `taper`, a part also ends where the running total of checked bytes crosses a
    `chunk_bounds` cut, as tapered requests end: the last part holds little."""
    plan, _, region, _ = _pulled(MemType.VRAM)
    sizes = _sizes(plan)
    total = sum(n for _, n in sizes)
    part = 8192
    bounds = chunk_bounds(total, part, 1).tolist()
    assert bounds == [part // 2, part, total - part, total - part // 2]
    names = [r.parameter for r in plan.reads]

    def cut(taper: int) -> list[list[str]]:
        check = RunningCheck(plan, region, part_bytes=part, taper=taper)
        check.advance(plan.nbytes)
        assert check.finish() == len(SHAPES)
        return [[names[i] for i in p.reads] for p in check._cut()]

    assert cut(0) == [["t0", "t1", "t2"], ["t3", "t4", "t5"]]
    assert cut(1) == [["t0"], ["t1", "t2"], ["t3", "t4"], ["t5"]]


def test_a_flipped_byte_fails_the_check_naming_its_shard(device: str = "cpu") -> None:
    plan, staging, region, _ = _pulled(MemType.VRAM, device)
    victim = max(range(len(plan.reads)), key=lambda i: _end(plan, i))  # in the last part
    staging[int(plan.reads[victim].dest_offsets[0]) + 5] ^= 0x40
    check = RunningCheck(plan, region, part_bytes=1)
    check.advance(plan.nbytes)
    name = plan.reads[victim].parameter
    with pytest.raises(ChecksumMismatch, match=f"{name} shard 0 .*wsum64"):
        check.finish()


def test_checksums_given_at_the_end_are_the_ones_compared(device: str = "cpu") -> None:
    """A pull that started before its version's checksums came (read before the version was
    readable) is compared with the checksums `finish` is given, read by read; the plan's own
    (an earlier version's) only say which reads are checked. So in host memory."""
    for mem_type in (MemType.VRAM, MemType.DRAM):
        plan, _, region, _ = _pulled(mem_type, device if mem_type is MemType.VRAM else "cpu")
        published = [Checksums(None, r.sum64) for r in plan.reads]
        stale = with_read_checksums(plan, [Checksums(None, (c.sum64 or 0) ^ 1) for c in published])

        def finish(sums: list[Checksums], plan: PullPlan = stale, region: Region = region) -> int:
            check = RunningCheck(plan, region, part_bytes=1)
            check.advance(plan.nbytes)
            return check.finish(sums)

        assert finish(published) == len(SHAPES)
        wrong = list(published)
        wrong[2] = Checksums(None, (published[2].sum64 or 0) ^ 1)
        with pytest.raises(ChecksumMismatch, match=f"{plan.reads[2].parameter} shard 0 .*wsum64"):
            finish(wrong)
        with pytest.raises(ValueError, match="checksums for the plan's"):
            finish(published[:-1])
        if mem_type is MemType.VRAM:
            missing = list(published)
            missing[1] = Checksums()
            with pytest.raises(ChecksumMismatch, match="published without a WSUM-64"):
                finish(missing)


def test_bytes_read_again_after_their_part_started_are_checked_after_a_restart(
    device: str = "cpu",
) -> None:
    """A part's sums are taken when it lands: bytes changed after that (a source failed and
    another delivered them again) go unseen unless the pull restarts the check."""
    plan, staging, region, _ = _pulled(MemType.VRAM, device)
    first = min(range(len(plan.reads)), key=lambda i: _end(plan, i))
    at = int(plan.reads[first].dest_offsets[0]) + 3

    check = RunningCheck(plan, region, part_bytes=1)
    check.advance(plan.nbytes)
    staging[at] ^= 0x01
    assert check.finish() == len(SHAPES)  # summed before the change

    staging[at] ^= 0x01
    check = RunningCheck(plan, region, part_bytes=1)
    check.advance(plan.nbytes)
    staging[at] ^= 0x01
    check.restart()
    with pytest.raises(ChecksumMismatch, match=f"{plan.reads[first].parameter} shard 0"):
        check.finish()


def test_host_memory_is_checked_at_the_end_as_verify_pulled_does() -> None:
    plan, staging, region, _ = _pulled(MemType.DRAM)
    check = RunningCheck(plan, region)
    check.advance(plan.nbytes)
    assert check.started == 0
    assert check.finish() == len(SHAPES)
    staging[10] ^= 0x08
    with pytest.raises(ChecksumMismatch):
        RunningCheck(plan, region).finish()
    with pytest.raises(ValueError, match="at least one byte"):
        RunningCheck(plan, region, part_bytes=0)


def test_a_part_that_cannot_start_is_never_raised_into_the_pull() -> None:
    """`advance` runs inside the pull's loop, with reads in flight: a part that cannot be
    summed there leaves the whole check to `finish`, where the error surfaces."""
    plan, staging, _, _ = _pulled(MemType.VRAM)
    orphan = Region(staging.data_ptr(), staging.numel(), MemType.VRAM, 0, owner=None)
    check = RunningCheck(plan, orphan)
    check.advance(plan.nbytes)  # does not raise
    with pytest.raises(ValueError, match="tensor that owns it"):
        check.finish()


def test_parted_sums_are_laid_out_once_per_layout_and_compare_only_when_all_started() -> None:
    plan, staging, region, _ = _pulled(MemType.VRAM)
    parts = [[0, 1], [2], [3, 4, 5]]
    first, again = PartedSums(plan, region, parts), PartedSums(plan, region, parts)
    assert first._layout is again._layout  # the next pull of the layout builds nothing
    first.start(2)  # in any order
    first.start(0)
    with pytest.raises(RuntimeError, match="never started"):
        first.check()
    first.start(1)
    assert first.check() == len(SHAPES)
    staging[int(plan.reads[2].dest_offsets[0])] ^= 0x10
    for part in range(3):
        again.start(part)
    with pytest.raises(ChecksumMismatch, match=f"{plan.reads[2].parameter} shard 0"):
        again.check()
    with pytest.raises(ValueError, match="no parts"):
        again.start(2, 4)
    small = staging[:16]
    with pytest.raises(ValueError, match="outside the buffer"):
        PartedSums(plan, Region(small.data_ptr(), 16, MemType.VRAM, 0, owner=small), parts)
    odd = staging[1:17]
    with pytest.raises(ValueError, match="whole, aligned 16-bit units"):
        PartedSums(plan, Region(odd.data_ptr(), 16, MemType.VRAM, 0, owner=odd), parts)


LARGE = [(256, 256), (16,), (512, 128), (40,), (256, 256), (300, 7)]
"""Shards of whole aligned WSUM blocks and of masked ones, in every part below."""


def test_consecutive_parts_start_together_as_one_run_of_each_kind_of_block() -> None:
    """The requests in flight at a pull's end land together: `advance` starts every part
    they filled at once (two launches on a GPU), with the same sums as part by part."""
    plan, staging, region, _ = _pulled(MemType.VRAM, shapes=LARGE)
    parts = [[0, 1], [2, 3], [4, 5]]
    together, apart = PartedSums(plan, region, parts), PartedSums(plan, region, parts)
    layout = together._layout
    assert all(hi > lo for lo, hi in layout.whole) and any(hi > lo for lo, hi in layout.rest)
    together.start(0, 2)
    with pytest.raises(RuntimeError, match="never started"):
        together.check()
    together.start(2, 3)
    for part in range(3):
        apart.start(part)
    assert together.check() == apart.check() == len(LARGE)
    assert torch.equal(together._partial, apart._partial)
    flipped = int(plan.reads[4].dest_offsets[0]) + 40_000  # in a whole block
    staging[flipped] ^= 0x01
    again = PartedSums(plan, region, parts)
    again.start(0, 3)
    with pytest.raises(ChecksumMismatch, match=f"{plan.reads[4].parameter} shard 0"):
        again.check()
    staging[flipped] ^= 0x01

    check = RunningCheck(plan, region, part_bytes=plan.nbytes // 4)
    check.advance(plan.nbytes // 2)
    first = check.started
    check.advance(plan.nbytes)  # the rest landed at once
    assert 0 < first < check.started == len(check._cut()) >= 3
    assert check.finish() == len(LARGE)
