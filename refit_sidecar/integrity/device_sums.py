"""WSUM-64 (`wsum`) of a torch buffer where it lives: a Triton kernel on a GPU, torch on a CPU.

`group_sums(buffer, plan)` sums the plan's blocks of a uint8 tensor into one checksum per group.
On CUDA with Triton each block of 16,384 units is one program: it loads the units once, hashes
their indices into weights in registers (32-bit arithmetic) and writes one partial sum; the
partial sums are added per group with integer atomics (exact in any order). One pass over the
bytes and two small launches, whatever the number of shards (docs/refit.md has its rate).
Elsewhere a torch implementation in int64 arithmetic gives the same value, slower.
`verify_device` checks a pull's device destination against the checksums of a plan's reads;
`PartedSums` does it in parts started while the pull lands (`running_check.py`), and sums the
reads of parts of shards for the engine's workers to add up (`partial_sums`).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from refit_sidecar.core.plan import PullPlan
from refit_sidecar.core.recent import Recent
from refit_sidecar.integrity import wsum
from refit_sidecar.integrity.checksum import ChecksumMismatch
from refit_sidecar.integrity.partial_sums import (
    PartialSums,
    collect,
    partial_layout,
    partial_reads,
)
from refit_sidecar.memory.region import Region

_TORCH_CHUNK = 1 << 24
"""Units per torch pass (int64 temporaries of 128 MiB each)."""


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, compiled on first use; None where Triton cannot run."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def wsum_blocks(  # noqa: PLR0917
        buf,
        blocks,
        out,
        FOLD: tl.constexpr,  # noqa: N803
        SEED: tl.constexpr,  # noqa: N803
        K1: tl.constexpr,  # noqa: N803
        K2: tl.constexpr,  # noqa: N803
        SHIFT1: tl.constexpr,  # noqa: N803
        SHIFT2: tl.constexpr,  # noqa: N803
        BLOCK: tl.constexpr,  # noqa: N803
        FULL: tl.constexpr,  # noqa: N803
    ):
        pid = tl.program_id(0)
        first = tl.load(blocks + 3 * pid)
        index = tl.load(blocks + 3 * pid + 2)
        lane = tl.arange(0, BLOCK)
        if FULL:
            # A whole block starting on 16 bytes: unmasked, vectorised loads.
            first = tl.multiple_of(first, 8)  # _ALIGNED_UNITS
            unit = tl.load(buf + first + lane).to(tl.uint16, bitcast=True)
        else:
            count = tl.load(blocks + 3 * pid + 1)
            unit = tl.load(buf + first + lane, mask=lane < count, other=0)
            unit = unit.to(tl.uint16, bitcast=True)
        j = index + lane
        z = j.to(tl.uint32) ^ ((j >> 32).to(tl.uint32) * FOLD)
        z = (z + SEED) * K1
        z = z ^ (z >> SHIFT1)
        z = z * K2
        z = z ^ (z >> SHIFT2)
        term = unit.to(tl.uint64) * (z | 1).to(tl.uint64)  # masked units load as 0
        tl.store(out + pid, tl.sum(term, axis=0).to(tl.int64, bitcast=True))

    return wsum_blocks


_ALIGNED_UNITS = 8
"""Units in 16 bytes: blocks that start there and are whole load without masks."""


def _whole_first(blocks: np.ndarray) -> tuple[np.ndarray, int]:
    """The order that puts a block table's whole aligned blocks (the kernel's unmasked
    variant) first, keeping the order within each kind, and how many those are."""
    whole = (blocks[:, 1] == wsum.BLOCK) & (blocks[:, 0] % _ALIGNED_UNITS == 0)
    return np.argsort(~whole, kind="stable"), int(whole.sum())


def _launch(
    kernel: Any, units: torch.Tensor, blocks: torch.Tensor, partial: torch.Tensor, whole: bool
) -> None:
    """One program per row of `blocks` (all whole aligned blocks when `whole`), each writing
    its partial sum into `partial`; nothing for no rows."""
    if len(blocks):
        kernel[(len(blocks),)](
            units,
            blocks,
            partial,
            FOLD=wsum.FOLD,
            SEED=wsum.SEED,
            K1=wsum.K1,
            K2=wsum.K2,
            SHIFT1=wsum.SHIFT1,
            SHIFT2=wsum.SHIFT2,
            BLOCK=wsum.BLOCK,
            FULL=whole,
        )


_device_tables = Recent(64)


def _tables(plan: wsum.SumPlan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The plan's block table and group numbers on `device`, whole aligned blocks first, and
    how many those are."""

    def make() -> tuple[wsum.SumPlan, torch.Tensor, torch.Tensor, int]:
        order, full = _whole_first(plan.blocks)
        blocks = torch.from_numpy(np.ascontiguousarray(plan.blocks[order])).to(device)
        return plan, blocks, torch.from_numpy(plan.groups[order]).to(device), full

    # Keyed by identity, and the plan kept with its tables so its id is never reused.
    _, blocks, groups, full = _device_tables.get((id(plan), device), make)
    return blocks, groups, full


def group_sums(buffer: torch.Tensor, plan: wsum.SumPlan, *, use_triton: bool = True) -> np.ndarray:
    """The plan's WSUM-64s over `buffer` (a contiguous 1-d uint8 tensor), uint64 per group, on
    the buffer's device and its current stream."""
    sums = device_group_sums(buffer, plan, use_triton=use_triton)
    return sums.cpu().numpy().view(np.uint64)


def device_group_sums(
    buffer: torch.Tensor, plan: wsum.SumPlan, *, use_triton: bool = True
) -> torch.Tensor:
    """`group_sums` as int64 on the buffer's device, queued on its current stream and not
    waited for."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError("WSUM-64 sums a contiguous 1-d uint8 tensor")
    if buffer.data_ptr() % wsum.UNIT or buffer.numel() % wsum.UNIT:
        raise ValueError("WSUM-64 needs a buffer of whole, aligned 16-bit units")
    if len(plan.blocks):
        last = plan.blocks[:, 0] + plan.blocks[:, 1]
        if plan.blocks[:, 0].min() < 0 or last.max() * wsum.UNIT > buffer.numel():
            raise ValueError("the sum plan reads outside the buffer")
    if not len(plan.blocks):
        return torch.zeros(plan.count, dtype=torch.int64, device=buffer.device)
    units = buffer.view(torch.int16)
    kernel = _kernel() if use_triton and buffer.is_cuda else None
    if kernel is not None:
        blocks, groups, full = _tables(plan, buffer.device)
        partial = torch.empty(len(plan.blocks), dtype=torch.int64, device=buffer.device)
        _launch(kernel, units, blocks[:full], partial[:full], True)
        _launch(kernel, units, blocks[full:], partial[full:], False)
    else:
        partial = _torch_blocks(units, plan)
        groups = torch.from_numpy(plan.groups).to(buffer.device)
    sums = torch.zeros(plan.count, dtype=torch.int64, device=buffer.device)
    sums.index_add_(0, groups, partial)
    return sums


def warm_up(device: torch.device) -> None:
    """Compile and load the kernel's variants on `device` now, so that a receiver's first
    check does not (Triton compiles on first launch, one variant per kind of block and per
    16-byte alignment of the tables' rows, which a part's first row may have or not); checks
    the sums against the host reference while at it. Nothing off CUDA."""
    kernel = _kernel()
    if device.type != "cuda" or kernel is None:
        return
    units = 3 * wsum.BLOCK + 3  # three whole aligned blocks, then a partial one
    data = np.random.default_rng(0).integers(0, 256, size=units * wsum.UNIT, dtype=np.uint8)
    plan = wsum.SumPlan.of([0], [data.nbytes], [0], [0], 1)
    buffer = torch.from_numpy(data).to(device)
    if not np.array_equal(group_sums(buffer, plan), plan.reference(data)):
        raise RuntimeError(f"the WSUM-64 kernel disagrees with the host reference on {device}")
    blocks, _, full = _tables(plan, device)
    partial = torch.empty(len(plan.blocks), dtype=torch.int64, device=device)
    for first in (0, 1):  # rows starting on 16 bytes, and not
        for whole in (True, False):
            _launch(kernel, buffer.view(torch.int16), blocks[first:full], partial[first:], whole)
    torch.cuda.synchronize(device)


def _torch_blocks(units: torch.Tensor, plan: wsum.SumPlan) -> torch.Tensor:
    """Partial sums per block in torch: a contiguous run of blocks (a piece) at a time."""
    out = torch.empty(len(plan.blocks), dtype=torch.int64, device=units.device)
    blocks = plan.blocks
    # Consecutive blocks of one piece continue each other in the buffer and in the shard.
    breaks = np.flatnonzero(
        (blocks[1:, 0] != blocks[:-1, 0] + blocks[:-1, 1])
        | (blocks[1:, 2] != blocks[:-1, 2] + blocks[:-1, 1])
        | (blocks[:-1, 1] != wsum.BLOCK)
    )
    starts = np.concatenate([[0], breaks + 1])
    ends = np.concatenate([breaks + 1, [len(blocks)]])
    m32 = wsum.MASK32
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        first, index = int(blocks[s, 0]), int(blocks[s, 2])
        total = int(blocks[s:e, 1].sum())
        run = torch.empty(total, dtype=torch.int64, device=units.device)
        for begin in range(0, total, _TORCH_CHUNK):
            n = min(_TORCH_CHUNK, total - begin)
            unit = units[first + begin : first + begin + n].to(torch.int64) & 0xFFFF
            j = torch.arange(index + begin, index + begin + n, device=units.device)
            # 32-bit arithmetic in int64: every value stays below 2**32 after its mask.
            z = (j & m32) ^ (((j >> 32) * wsum.FOLD) & m32)
            z = ((z + wsum.SEED) * wsum.K1) & m32
            z = z ^ (z >> wsum.SHIFT1)
            z = (z * wsum.K2) & m32
            z = z ^ (z >> wsum.SHIFT2)
            run[begin : begin + n] = unit * (z | 1)
        # Block by block, as the kernel cuts them (sums are exact in any grouping).
        bounds = np.cumsum(blocks[s:e, 1])[:-1].tolist()
        out[s:e] = torch.stack([p.sum() for p in torch.tensor_split(run, bounds)])
    return out


def region_tensor(region: Region) -> torch.Tensor:
    """The bytes of `region` as a uint8 tensor: its owner must be the 1-d uint8 tensor holding
    them, or an object (a `TorchArena`) whose `tensor` is."""
    owner = region.owner
    owner = getattr(owner, "tensor", owner)
    if not isinstance(owner, torch.Tensor) or owner.dtype != torch.uint8 or owner.dim() != 1:
        raise ValueError("a device region is checked through the uint8 tensor that owns it")
    start = region.address - owner.data_ptr()
    if start < 0 or start + region.nbytes > owner.numel():
        raise ValueError("the region lies outside the tensor that owns it")
    return owner[start : start + region.nbytes]


def verify_device(plan: PullPlan, dest: Region) -> int:
    """Check the WSUM-64 of every shard of `plan` read whole into `dest` (device memory, or a
    CPU tensor) that carries one; returns how many were checked. ChecksumMismatch names the
    first shard that differs."""
    checked = [i for i, r in enumerate(plan.reads) if r.complete and r.sum64 is not None]
    sums = PartedSums(plan, dest, [checked])
    sums.start(0)
    return sums.check()


def device_partial_sums(
    plan: PullPlan, dest: Region, published: Sequence[int | None] | None = None
) -> PartialSums:
    """The WSUM-64s of `plan`'s partial reads landed in `dest` (device memory, or a CPU
    tensor), summed where it is."""
    indices = partial_reads(plan)
    layout = partial_layout(plan, indices)
    values = group_sums(region_tensor(dest), layout.table)
    return collect(plan, indices, values, published, layout)


class PartedSums:
    """The WSUM-64s of a pull's checked reads, started a part at a time while the pull runs
    (`running_check.RunningCheck`) and compared once at the end.

    Everything a part needs is laid out once per layout (the same parts of the same reads: a
    refit's every version) and kept on the device: one block table holding every part's
    whole aligned blocks, part after part, then every part's other blocks in the same order,
    and their groups. Consecutive parts' rows of each kind are then one run of the table, so
    starting any number of consecutive parts is two kernel launches writing their rows of one
    buffer of partial sums: the requests in flight at a pull's end land together, and one
    launch pair per part (Python and launches each) stood between their last byte and their
    sums. `check` adds the partial sums per read (one launch),
    copies them to the host once and compares. Started with a part's own tables, sums and
    reduction, each part cost several launches (the pull's loop and its publisher share that
    thread's interpreter)."""

    def __init__(self, plan: PullPlan, dest: Region, parts: Sequence[Sequence[int]]) -> None:
        """`parts`: the indices in `plan.reads` of each part's reads (each with a WSUM-64: a
        read whole is compared, a read of part of a shard summed for the engine's workers to
        add up, `partial_sums`); in the order they are to be started."""
        self._plan = plan
        buffer = region_tensor(dest)
        if buffer.data_ptr() % wsum.UNIT or buffer.numel() % wsum.UNIT:
            raise ValueError("WSUM-64 needs a buffer of whole, aligned 16-bit units")
        self._units = buffer.view(torch.int16)
        self._layout = _parted_layouts.get(
            (_layout_digest(plan, parts), buffer.device),
            lambda: _PartedLayout(plan, parts, buffer.device),
        )
        layout = self._layout
        if len(layout.blocks) and int(layout.last_unit) * wsum.UNIT > buffer.numel():
            raise ValueError("the sum plan reads outside the buffer")
        self._kernel = _kernel() if buffer.is_cuda else None
        # Every row is written by its part's start before `check` reads any (the parts' rows
        # tile the table): no fill needs queueing on the listener lane.
        self._partial = torch.empty(len(layout.blocks), dtype=torch.int64, device=buffer.device)
        self._started = [False] * len(parts)
        self.partial: dict[int, int] = {}
        """After `check`: the WSUM-64 of each read of part of a shard, by index in the plan."""

    def start(self, part: int, stop: int | None = None) -> None:
        """Queue the sums of parts `part` up to `stop` (exclusive; default: that one part) on
        the current stream, in two launches whatever their number."""
        stop = part + 1 if stop is None else stop
        if not 0 <= part < stop <= len(self._started):
            raise ValueError(f"no parts {part}..{stop - 1} among {len(self._started)}")
        layout = self._layout
        runs = (
            (layout.whole[part][0], layout.whole[stop - 1][1], True),
            (layout.rest[part][0], layout.rest[stop - 1][1], False),
        )
        for lo, hi, whole in runs:
            if hi <= lo:
                continue
            if self._kernel is None:
                rows = wsum.SumPlan(layout.host_blocks[lo:hi], layout.host_groups[lo:hi], 1)
                self._partial[lo:hi] = _torch_blocks(self._units, rows)
            else:
                blocks, partial = layout.blocks[lo:hi], self._partial[lo:hi]
                _launch(self._kernel, self._units, blocks, partial, whole)
        self._started[part:stop] = [True] * (stop - part)

    def check(self, published: Sequence[int | None] | None = None) -> int:
        """Waits for the sums (every part started) and compares each read whole with its
        published WSUM-64 (`published[i]` for read `i` when they came later, else the plan's);
        returns how many were checked, and keeps the other reads' sums (`partial`).
        ChecksumMismatch names the first that differs, in the plan's order, or a read
        published without one."""
        if not all(self._started):
            raise RuntimeError("a part was never started")
        layout = self._layout
        if not layout.indices:
            return 0
        sums = torch.zeros(len(layout.indices), dtype=torch.int64, device=self._partial.device)
        sums.index_add_(0, layout.groups, self._partial)
        got = sums.cpu().numpy().view(np.uint64).tolist()
        reads = self._plan.reads
        self.partial = {}
        for value, i in sorted(zip(got, layout.indices, strict=True), key=lambda pair: pair[1]):
            if not reads[i].complete:
                self.partial[i] = value  # checked by the engine's workers together
                continue
            expected = reads[i].sum64 if published is None else published[i]
            if expected is None:
                raise ChecksumMismatch(
                    f"{reads[i].parameter} shard {reads[i].shard}: published without a WSUM-64"
                )
            if value != expected:
                raise ChecksumMismatch.of(reads[i], "wsum64", value, expected)
        return len(layout.indices) - len(self.partial)

    def partial_sums(self, published: Sequence[int | None] | None = None) -> PartialSums:
        """After `check`: the sums of the parts' partial reads (`partial_sums.PartialSums`)."""
        indices = sorted(self.partial)
        values = np.array([self.partial[i] for i in indices], np.uint64)
        return collect(self._plan, indices, values, published)


class _PartedLayout:
    """`PartedSums`' tables for one layout of parts, on one device."""

    def __init__(self, plan: PullPlan, parts: Sequence[Sequence[int]], device: torch.device):
        self.indices = [i for part in parts for i in part]
        kinds: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])  # whole blocks, the rest
        kind_groups: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
        counts: list[tuple[int, int]] = []
        group = 0
        for part in parts:
            reads = [plan.reads[i] for i in part]
            whole = rest = 0
            if reads:
                piece_groups = np.repeat(
                    np.arange(group, group + len(reads)), [len(r.lengths) for r in reads]
                )
                sums = wsum.SumPlan.of(
                    np.concatenate([r.dest_offsets for r in reads]),
                    np.concatenate([r.lengths for r in reads]),
                    np.concatenate([r.shard_offsets for r in reads]),
                    piece_groups,
                    group + len(reads),
                )
                order, whole = _whole_first(sums.blocks)
                rest = len(order) - whole
                for kind, rows in ((0, order[:whole]), (1, order[whole:])):
                    kinds[kind].append(sums.blocks[rows])
                    kind_groups[kind].append(sums.groups[rows])
            counts.append((whole, rest))
            group += len(reads)
        # Every part's whole blocks, part after part, then every part's other blocks.
        wholes = sum(w for w, _ in counts)
        self.whole: list[tuple[int, int]] = []
        """Per part: its rows of whole aligned blocks, [start, stop) of the table."""
        self.rest: list[tuple[int, int]] = []
        """Per part: its other rows."""
        at, other = 0, wholes
        for whole, rest in counts:
            self.whole.append((at, at + whole))
            self.rest.append((other, other + rest))
            at, other = at + whole, other + rest
        taken = other
        blocks = kinds[0] + kinds[1]
        self.host_blocks = (
            np.ascontiguousarray(np.concatenate(blocks)) if blocks else np.zeros((0, 3), np.int64)
        )
        groups = kind_groups[0] + kind_groups[1]
        self.host_groups = np.concatenate(groups) if groups else np.zeros(0, np.int64)
        self.last_unit = (
            int((self.host_blocks[:, 0] + self.host_blocks[:, 1]).max()) if taken else 0
        )
        if taken and self.host_blocks[:, 0].min() < 0:
            raise ValueError("the sum plan reads outside the buffer")
        self.blocks = torch.from_numpy(self.host_blocks).to(device)
        self.groups = torch.from_numpy(self.host_groups).to(device)


_parted_layouts = Recent(16)


def _layout_digest(plan: PullPlan, parts: Sequence[Sequence[int]]) -> bytes:
    """What decides `_PartedLayout`: each part's reads, where their bytes lie."""
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        digest.update(np.array([len(part)], np.int64).tobytes())
        for i in part:
            r = plan.reads[i]
            digest.update(np.array([i, len(r.lengths)], np.int64).tobytes())
            for array in (r.dest_offsets, r.lengths, r.shard_offsets):
                digest.update(np.ascontiguousarray(array, dtype=np.int64).tobytes())
    return digest.digest()
