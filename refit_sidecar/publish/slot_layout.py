"""Where each parameter lands in a snapshot slot, so the snapshot is a few large copies.

Megatron keeps a rank's parameters as views of a few contiguous buffers (one per dtype in its
DDP param-and-grad buffers). Laying a slot out as a copy of those buffers' byte ranges, not
parameter by parameter, turns a snapshot of hundreds of tensors into one copy per buffer: on a
GPU, one launch per buffer instead of one per tensor, which is what the step waits for. Pure
and torch-free: parameters come in as (name, storage, byte offset in it, size in bytes).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    name: str
    storage: int
    """Which allocation holds the parameter's bytes (an id, such as its address); parameters
    of one storage may share a copy."""
    start: int
    """Byte offset of the parameter in its storage."""
    nbytes: int


@dataclass(frozen=True)
class Region:
    """One copy of a snapshot: bytes [start, stop) of `storage` to `offset` in the slot."""

    storage: int
    start: int
    stop: int
    offset: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class SnapshotLayout:
    offsets: dict[str, int]
    """Byte offset of each parameter in the slot."""
    regions: tuple[Region, ...]
    nbytes: int
    """Size of the slot."""


@dataclass(frozen=True)
class Group:
    """A published tensor made of several parameters (a layer's experts, in expert order),
    laid out back to back in the slot so that it is one C-order tensor there, wherever its
    members live in their storage."""

    name: str
    members: tuple[Placement, ...]

    def __post_init__(self) -> None:
        if not self.members:
            raise ValueError(f"group {self.name} has no members")

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.members)

    def segments(self) -> list[tuple[int, int, int]]:
        """(storage, start, stop) byte ranges to copy, in slot order: members that already lie
        back to back in one storage make one range (one copy)."""
        out: list[tuple[int, int, int]] = []
        for m in self.members:
            if out and out[-1][0] == m.storage and out[-1][2] == m.start:
                out[-1] = (m.storage, out[-1][1], m.start + m.nbytes)
            else:
                out.append((m.storage, m.start, m.start + m.nbytes))
        return out


@dataclass(frozen=True)
class _Block:
    """Bytes laid out together in the slot: copies of (storage, start, stop) back to back, and
    where each name starts in the block."""

    segments: tuple[tuple[int, int, int], ...]
    names: tuple[tuple[str, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(stop - start for _, start, stop in self.segments)


def snapshot_layout(
    placements: Sequence[Placement],
    alignment: int,
    max_gap: int = 1 << 20,
    groups: Sequence[Group] = (),
) -> SnapshotLayout:
    """Groups parameters by storage into byte ranges (bridging gaps of up to `max_gap` bytes
    that no listed parameter covers, such as padding, rather than starting another copy) and
    lays the ranges out one after another, smallest first, each at an `alignment` boundary.
    Within a range, parameters keep their relative positions. Each of `groups` is laid out as
    its members back to back in their order (a range of its own, one copy per run of members
    adjacent in their storage); a gap holding a group member's bytes is not bridged."""
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    names = [p.name for p in placements] + [g.name for g in groups]
    if len(set(names)) != len(names):
        raise ValueError("every parameter is placed once")
    claimed: dict[int, list[Placement]] = {}
    for p in [*placements, *(m for g in groups for m in g.members)]:
        if p.nbytes <= 0 or p.start < 0:
            raise ValueError(f"{p.name}: bad byte range {p.start} + {p.nbytes}")
        claimed.setdefault(p.storage, []).append(p)
    for spans in claimed.values():
        spans.sort(key=lambda p: p.start)
        for before, after in itertools.pairwise(spans):
            if after.start < before.start + before.nbytes:
                raise ValueError(f"{after.name} overlaps {before.name} in their storage")
    grouped: dict[int, list[int]] = {s: [] for s in claimed}
    for g in groups:
        for m in g.members:
            grouped[m.storage].append(m.start)
    for starts in grouped.values():
        starts.sort()
    by_storage: dict[int, list[Placement]] = {}
    for p in placements:
        by_storage.setdefault(p.storage, []).append(p)
    blocks: list[_Block] = []
    for storage, members in by_storage.items():
        members.sort(key=lambda p: p.start)
        runs: list[list[Placement]] = []
        for p in members:
            stop = runs[-1][-1].start + runs[-1][-1].nbytes if runs else 0
            if runs and p.start - stop <= max_gap and not _holds(grouped[storage], stop, p.start):
                runs[-1].append(p)
            else:
                runs.append([p])
        for run in runs:
            first, last = run[0], run[-1]
            blocks.append(
                _Block(
                    ((storage, first.start, last.start + last.nbytes),),
                    tuple((m.name, m.start - first.start) for m in run),
                )
            )
    blocks.extend(_Block(tuple(g.segments()), ((g.name, 0),)) for g in groups)
    # Smallest first: the copy runs in slot order, in pieces receivers read behind
    # (`piece_ends`), and a receiver's request holds each layer's small tensors (norms kept
    # in float32, a buffer of their own) beside its weights; laid out last, they made every
    # request wait for the end of the copy.
    blocks.sort(key=lambda b: b.nbytes)
    offsets: dict[str, int] = {}
    regions: list[Region] = []
    size = 0
    for block in blocks:
        for name, at in block.names:
            offsets[name] = size + at
        for storage, start, stop in block.segments:
            regions.append(Region(storage, start, stop, size))
            size += stop - start
        size = -(-size // alignment) * alignment
    return SnapshotLayout(offsets, tuple(regions), size)


def _holds(starts: list[int], lo: int, hi: int) -> bool:
    """Whether a grouped member starts in [lo, hi) (members never straddle a placement)."""
    i = bisect.bisect_left(starts, lo)
    return i < len(starts) and starts[i] < hi


DEFAULT_FIRST_PIECE_BYTES = 32 << 20
"""The first piece of a snapshot copy (`piece_ends`): a receiver's first read waits for it
alone, a small part of the copy; the pieces after it double, so a 6 GB slot takes 8 pieces,
and the copy, several times faster than a receiver's reads over NVLink, stays ahead of them."""


def piece_ends(nbytes: int, first: int) -> tuple[int, ...]:
    """Where the pieces of a slot of `nbytes` bytes end: the first after `first` bytes, each
    next one twice as long as the one before, the last at `nbytes`; one piece when `first` is
    0 or covers the slot."""
    if nbytes <= 0 or first < 0:
        raise ValueError(f"bad slot size {nbytes} or first piece {first}")
    ends: list[int] = []
    size, end = first, 0
    while first and end + size < nbytes:
        end += size
        ends.append(end)
        size *= 2
    ends.append(nbytes)
    return tuple(ends)


def cut_into_pieces(regions: Sequence[Region], ends: Sequence[int]) -> list[list[Region]]:
    """The snapshot's copies cut at the piece `ends` (slot offsets): per piece, the parts of
    the regions that land in it, in slot order (a piece in alignment padding only has none)."""
    pieces: list[list[Region]] = [[] for _ in ends]
    for region in sorted(regions, key=lambda r: r.offset):
        at = region.offset
        stop = region.offset + region.nbytes
        while at < stop:
            piece = bisect.bisect_right(ends, at)
            if piece == len(ends):
                raise ValueError(f"a region ends at {stop}, past the slot's last piece")
            upto = min(stop, ends[piece])
            start = region.start + at - region.offset
            pieces[piece].append(Region(region.storage, start, start + upto - at, at))
            at = upto
    return pieces
