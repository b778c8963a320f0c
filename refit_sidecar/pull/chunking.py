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

from refit_sidecar.core.manifest import MemType
from refit_sidecar.core.plan import PullPlan
from refit_sidecar.memory.region import Region

DEFAULT_REQUESTS_IN_FLIGHT = 4
"""A receiver's direct pull keeps this many requests in flight (`RefitOptions.direct`): a few
at a time moved a pull faster than all of them posted at once (BENCHMARKS.md, refit_install), and
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


Request = tuple[tuple[str, MemType], tuple[np.ndarray, np.ndarray]]
"""A READ request: (source agent, its memory type), (remote, local) N×3 descriptors."""


def requests_of(plan: PullPlan, dest: Region, size: int, taper: int = 0) -> list[Request]:
    """The plan's READ requests: per source (agent, memory type, device), its reads in
    destination order cut into requests of about `size` bytes (`chunking`; with `taper`, at
    `chunk_bounds`, halving towards the ends), each as (remote, local) N×3 uint64 descriptor
    arrays (address, length, device)."""
    parts: dict[tuple[str, MemType, int], list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    for reads in plan.reads:
        loc = reads.location
        parts.setdefault((loc.agent, loc.mem_type, loc.device_id), []).append(
            (reads.remote_addresses, reads.lengths, reads.dest_offsets)
        )
    out = []
    for (agent, mem_type, device), group in parts.items():
        remote = np.concatenate([p[0] for p in group]).astype(np.uint64)
        length = np.concatenate([p[1] for p in group])
        dst = np.concatenate([p[2] for p in group])
        order = np.argsort(dst, kind="stable")
        if taper:
            bounds = chunk_bounds(int(length.sum()), size, taper)
            remote, length, dst, request = cut_at(remote[order], length[order], dst[order], bounds)
        else:
            remote, length, dst = cut_long(remote[order], length[order], dst[order], size)
            request = np.zeros(len(length), np.int64)
            for i, idx in enumerate(groups(length, size)):
                request[idx] = i
        remote, length, dst, request = merge_continuing(remote, length, dst, request)
        for idx in np.split(np.arange(len(request)), np.flatnonzero(np.diff(request)) + 1):
            n = length[idx].astype(np.uint64)
            same = len(idx)
            r = np.stack([remote[idx], n, np.full(same, device, np.uint64)]).T
            local_addr = dst[idx].astype(np.uint64) + np.uint64(dest.address)
            d = np.stack([local_addr, n, np.full(same, dest.device_id, np.uint64)]).T
            out.append(((agent, mem_type), (np.ascontiguousarray(r), np.ascontiguousarray(d))))
    return out
