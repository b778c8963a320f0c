"""Cutting a source's reads into requests of a bounded size, for every pull: the direct pull
posts a few at a time in destination order (several READ requests in flight move more bytes
per second than one request holding every read), the pipelined pull posts them as a parent's
copy advances.

Reads are three aligned arrays: the source's addresses (uint64), lengths and destination
offsets (int64). A read longer than `size` is cut into pieces of `size` bytes (the last one
shorter); consecutive reads are then grouped into requests of about `size` bytes each.
"""

from __future__ import annotations

import numpy as np

DEFAULT_REQUESTS_IN_FLIGHT = 4
"""A receiver's direct pull keeps this many requests in flight (`RefitOptions`): on two H100s
the 1B model's 1.96 GB moved in 7.9 ms against 8.4-8.8 ms with all of them posted at once, and
its bytes land in order, so the running check sums most of them during the pull."""


def cut_long(
    remote: np.ndarray, length: np.ndarray, dst: np.ndarray, size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The reads with each one longer than `size` cut into consecutive pieces of `size`."""
    if size < 1:
        raise ValueError(f"a request holds at least one byte, got {size}")
    length = length.astype(np.int64)
    pieces = np.maximum(1, -(-length // size))
    if int(pieces.max(initial=1)) == 1:
        return remote, length, dst.astype(np.int64)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    k = np.arange(int(pieces.sum())) - first
    owner = np.repeat(np.arange(len(length)), pieces)
    offset = k * size
    return (
        remote[owner] + offset.astype(np.uint64),
        np.minimum(length[owner] - offset, size),
        dst[owner].astype(np.int64) + offset,
    )


def groups(length: np.ndarray, size: int) -> list[np.ndarray]:
    """Indices of consecutive reads, in order, one group per request: a group ends with the
    read that takes the running total of bytes to the next multiple of `size` (so, with reads
    cut by `cut_long`, a group holds less than twice `size`)."""
    if not len(length):
        return []
    ends = np.cumsum(length)
    bounds = np.searchsorted(ends, np.arange(size, int(ends[-1]), size), side="left") + 1
    cuts = np.unique(bounds[bounds < len(length)])
    return [idx for idx in np.split(np.arange(len(length)), cuts) if len(idx)]


def chunk_bounds(total: int, size: int, taper: int = 0) -> np.ndarray:
    """Where a source's `total` bytes of reads are cut into chunks (int64, increasing, each
    inside (0, total)): every `size` bytes; with `taper`, the first and the last `size` bytes
    are cut into chunks halving `taper` times towards the ends (size/2, size/4, ...,
    size/2**taper, size/2**taper), so a child waits for a small first chunk of its parent's
    before it starts and reads only a small last one after its parent ends."""
    if size < 1 or taper < 0 or size >> taper < 1:
        raise ValueError(f"bad chunk size {size} or taper {taper}")
    bounds = set(range(size, total, size))
    if taper:
        head = np.cumsum([size >> taper] + [size >> k for k in range(taper, 0, -1)])
        bounds.update(int(p) for p in head if 0 < p < total)
        bounds.update(int(total - p) for p in head if 0 < total - p < total)
        # The middle keeps whole chunks: no cut of the plain grid closer to an end than size.
        bounds = {b for b in bounds if b in head or total - b in head or size <= b <= total - size}
    return np.array(sorted(bounds), dtype=np.int64)


def cut_at(
    remote: np.ndarray, length: np.ndarray, dst: np.ndarray, bounds: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Consecutive reads (in the order they are to be read) cut where their running total of
    bytes crosses one of `bounds`; with each piece's chunk (how many bounds lie at or before
    its first byte)."""
    length = length.astype(np.int64)
    dst = dst.astype(np.int64)
    ends = np.cumsum(length)
    starts = ends - length
    if not len(bounds) or not len(length):
        return remote, length, dst, np.searchsorted(bounds, starts, side="right")
    lo = np.searchsorted(bounds, starts, side="right")  # first bound after a read's start
    inside = np.searchsorted(bounds, ends, side="left") - lo  # bounds strictly inside it
    pieces = inside + 1
    owner = np.repeat(np.arange(len(length)), pieces)
    k = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    last = len(bounds) - 1
    first = np.where(k == 0, starts[owner], bounds[np.minimum(lo[owner] + k - 1, last)])
    end = np.where(k == inside[owner], ends[owner], bounds[np.minimum(lo[owner] + k, last)])
    offset = first - starts[owner]
    return (
        remote[owner] + offset.astype(np.uint64),
        end - first,
        dst[owner] + offset,
        np.searchsorted(bounds, first, side="right"),
    )


def merge_continuing(
    remote: np.ndarray, length: np.ndarray, dst: np.ndarray, chunk: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Consecutive reads of one chunk that continue each other in the source and in the
    destination alike, as one read: a request's cost grows with its descriptors (a trainer's
    arena and a receiver's staging often lay tensors out in the same order, a peer's copy
    always does). Only reads with no byte between them merge, so no other read's bytes are
    ever covered."""
    if len(length) < 2:
        return remote, length, dst, chunk
    length = length.astype(np.int64)
    joins = (
        (remote[1:] == remote[:-1] + length[:-1].astype(np.uint64))
        & (dst[1:] == dst[:-1] + length[:-1])
        & (chunk[1:] == chunk[:-1])
    )
    first = np.concatenate([[True], ~joins])
    starts = np.flatnonzero(first)
    return (
        remote[starts],
        np.add.reduceat(length, starts),
        dst[starts],
        chunk[starts],
    )
