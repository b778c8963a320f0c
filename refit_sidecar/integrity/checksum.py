"""Shard checksums: the CRC-32 (zlib) and the WSUM-64 (`wsum`) of a host slot's shard, and the
WSUM-64 of a device slot's shard, computed on the GPU.

They catch torn or misplaced reads, not tampering. A source computes them when it publishes a
version; a puller that read a shard whole recomputes them from the destination buffer, walking
the reads in shard order for the CRC (a shard may land in the destination in several places),
piece by piece for the WSUM (each piece weighted from its offset in the shard).
`verify.verify_pulled` checks a destination where it is: host memory here, device memory on its
own GPU (`device_sums`).
"""

from __future__ import annotations

import zlib

import numpy as np

from refit_sidecar.core.plan import Checksums, PullPlan, ShardReads
from refit_sidecar.integrity.wsum import MASK64, UNIT, host_wsum64


class ChecksumMismatch(RuntimeError):
    """Pulled bytes differ from what the source published: never install them."""

    @classmethod
    def of(cls, reads: ShardReads, kind: str, got: int, published: int) -> ChecksumMismatch:
        """The mismatch of one shard's `kind` checksum ("crc32" or "wsum64")."""
        digits = 8 if kind == "crc32" else 16
        return cls(
            f"{reads.parameter} shard {reads.shard} from {reads.location.agent}: "
            f"{kind} {got:#0{digits + 2}x} != published {published:#0{digits + 2}x}"
        )


def checksum(data: np.ndarray) -> int:
    """CRC-32 of a contiguous array's bytes."""
    return zlib.crc32(np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)


def host_checksums(data: np.ndarray) -> Checksums:
    """What a host slot publishes for a shard: its CRC-32, and its WSUM-64 too, which a
    receiver that read only part of the shard sums with the engine's other workers
    (`partial_sums`; the CRC does not add up over pieces)."""
    return Checksums(checksum(data), host_wsum64(data))


def verify_checksums(plan: PullPlan, dest: np.ndarray) -> int:
    """Check every shard read whole into host memory that carries a checksum (its CRC-32, or
    its WSUM-64 where it has no CRC); returns how many were checked."""
    view = dest.reshape(-1).view(np.uint8)
    checked = 0
    for reads in plan.reads:
        if not reads.complete:
            continue
        if reads.crc32 is None:
            if reads.sum64 is not None:
                _verify_sum64(reads, view, reads.sum64)
                checked += 1
            continue
        crc = 0
        for i in np.argsort(reads.shard_offsets, kind="stable"):
            start = int(reads.dest_offsets[i])
            crc = zlib.crc32(view[start : start + int(reads.lengths[i])].data, crc)
        if crc != reads.crc32:
            raise ChecksumMismatch.of(reads, "crc32", crc, reads.crc32)
        checked += 1
    return checked


def _verify_sum64(reads: ShardReads, view: np.ndarray, published: int) -> None:
    total = 0
    starts, lengths = reads.dest_offsets.tolist(), reads.lengths.tolist()
    for start, length, at in zip(starts, lengths, reads.shard_offsets.tolist(), strict=True):
        total += host_wsum64(view[start : start + length], at // UNIT)
    total &= MASK64
    if total != published:
        raise ChecksumMismatch.of(reads, "wsum64", total, published)
