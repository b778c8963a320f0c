"""Cutting a source's reads into requests of a bounded size, for every pull: the direct pull
posts them all at once (several READ requests in flight move more bytes per second than one
request holding every read), the pipelined pull posts them as a parent's copy advances.

Reads are three aligned arrays: the source's addresses (uint64), lengths and destination
offsets (int64). A read longer than `size` is cut into pieces of `size` bytes (the last one
shorter); consecutive reads are then grouped into requests of about `size` bytes each.
"""

from __future__ import annotations

import numpy as np


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
