"""Where each parameter lands in a snapshot slot, so the snapshot is a few large copies.

Megatron keeps a rank's parameters as views of a few contiguous buffers (one per dtype in its
DDP param-and-grad buffers). Laying a slot out as a copy of those buffers' byte ranges, not
parameter by parameter, turns a snapshot of hundreds of tensors into one copy per buffer: on a
GPU, one launch per buffer instead of one per tensor, which is what the step waits for. Pure
and torch-free: parameters come in as (name, storage, byte offset in it, size in bytes).
"""

from __future__ import annotations

import bisect
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


def snapshot_layout(
    placements: Sequence[Placement], alignment: int, max_gap: int = 1 << 20
) -> SnapshotLayout:
    """Groups parameters by storage into byte ranges (bridging gaps of up to `max_gap` bytes
    that no listed parameter covers, such as padding, rather than starting another copy) and
    lays the ranges out one after another, smallest first, each at an `alignment` boundary.
    Within a range, parameters keep their relative positions."""
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    names = [p.name for p in placements]
    if len(set(names)) != len(names):
        raise ValueError("every parameter is placed once")
    by_storage: dict[int, list[Placement]] = {}
    for p in placements:
        if p.nbytes <= 0 or p.start < 0:
            raise ValueError(f"{p.name}: bad byte range {p.start} + {p.nbytes}")
        by_storage.setdefault(p.storage, []).append(p)
    ranges: list[tuple[int, list[Placement]]] = []
    for storage, members in by_storage.items():
        members.sort(key=lambda p: p.start)
        groups: list[list[Placement]] = []
        for p in members:
            stop = groups[-1][-1].start + groups[-1][-1].nbytes if groups else 0
            if groups and p.start < stop:
                raise ValueError(f"{p.name} overlaps {groups[-1][-1].name} in their storage")
            if groups and p.start - stop <= max_gap:
                groups[-1].append(p)
            else:
                groups.append([p])
        ranges.extend((storage, group) for group in groups)
    # Smallest first: the copy runs in slot order, in pieces receivers read behind
    # (`piece_ends`), and a receiver's request holds each layer's small tensors (norms kept
    # in float32, a buffer of their own) beside its weights; laid out last, they made every
    # request wait for the end of the copy.
    ranges.sort(key=lambda r: r[1][-1].start + r[1][-1].nbytes - r[1][0].start)
    offsets: dict[str, int] = {}
    regions: list[Region] = []
    size = 0
    for storage, group in ranges:
        start, stop = group[0].start, group[-1].start + group[-1].nbytes
        regions.append(Region(storage, start, stop, size))
        for member in group:
            offsets[member.name] = size + member.start - start
        size = -(-(size + stop - start) // alignment) * alignment
    return SnapshotLayout(offsets, tuple(regions), size)


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
