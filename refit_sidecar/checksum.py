"""Shard checksums: CRC-32 (zlib) of a shard buffer's bytes, ~4.8 GiB/s on one core here.

It catches torn or misplaced reads, not tampering. A source computes it when it publishes a
version; a puller that read a shard whole recomputes it from the destination buffer, walking
the reads in shard order (a shard may land in the destination in several places).
"""

from __future__ import annotations

import zlib

import numpy as np

from refit_sidecar.plan import PullPlan


class ChecksumMismatch(RuntimeError):
    """Pulled bytes differ from what the source published: never install them."""


def checksum(data: np.ndarray) -> int:
    """CRC-32 of a contiguous array's bytes."""
    return zlib.crc32(np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)


def verify_checksums(plan: PullPlan, dest: np.ndarray) -> int:
    """Check every shard read whole that carries a checksum; returns how many were checked."""
    view = dest.reshape(-1).view(np.uint8)
    checked = 0
    for reads in plan.reads:
        if reads.crc32 is None or not reads.complete:
            continue
        crc = 0
        for i in np.argsort(reads.shard_offsets, kind="stable"):
            start = int(reads.dest_offsets[i])
            crc = zlib.crc32(view[start : start + int(reads.lengths[i])].data, crc)
        if crc != reads.crc32:
            raise ChecksumMismatch(
                f"{reads.parameter} shard {reads.shard} from {reads.location.agent}: "
                f"crc32 {crc:#010x} != published {reads.crc32:#010x}"
            )
        checked += 1
    return checked
