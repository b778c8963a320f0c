"""Checking a pull's bytes where they landed: CRC-32 or WSUM-64 on the host, WSUM-64 on
the device (`device_sums`, imported only there: torch is there); and summing the reads of parts
of shards, which the engine's workers check together (`partial_sums`)."""

from __future__ import annotations

from refit_sidecar.core.manifest import MemType
from refit_sidecar.core.plan import PullPlan, ShardReads
from refit_sidecar.integrity.checksum import verify_checksums
from refit_sidecar.integrity.partial_sums import PartialSums, host_partial_sums
from refit_sidecar.memory.region import Region, host_view


def verify_pulled(plan: PullPlan, dest: Region) -> int:
    """Check every shard of `plan` read whole into `dest` that carries a checksum, where `dest`
    is (host memory here, device memory on its own GPU); returns how many were checked.
    ChecksumMismatch names the first that differs."""
    if dest.mem_type is MemType.DRAM:
        return verify_checksums(plan, host_view(dest))
    from refit_sidecar.integrity.device_sums import verify_device  # device memory: torch is there

    return verify_device(plan, dest)


def partial_sums_pulled(plan: PullPlan, dest: Region) -> PartialSums | None:
    """The WSUM-64s of the reads of `plan` of part of a shard, where `dest` is: for the
    engine's workers to add up (`partial_sums`). None for a plan that does not know its
    manifest's shard order."""
    if plan.shard_order is None:
        return None
    if dest.mem_type is MemType.DRAM:
        return host_partial_sums(plan, host_view(dest))
    from refit_sidecar.integrity.device_sums import device_partial_sums

    return device_partial_sums(plan, dest)


def check_pulled(plan: PullPlan, dest: Region) -> tuple[int, PartialSums | None]:
    """`verify_pulled`, then the partial reads' sums (`partial_sums_pulled`): what a pull's
    check finds where it does not run alongside the pull."""
    return verify_pulled(plan, dest), partial_sums_pulled(plan, dest)


def unverified_bytes(plan: PullPlan, dest: Region) -> int:
    """Bytes of `plan` that `verify_pulled` into `dest` does not check (reads of part of a
    shard, shards published without the checksum that memory is checked with)."""
    host = dest.mem_type is MemType.DRAM
    return sum(r.nbytes for r in plan.reads if not _checked(r, host))


def verifies_every_read(plan: PullPlan, dest: Region) -> bool:
    """Whether `verify_pulled` into `dest` checks every byte of `plan`."""
    host = dest.mem_type is MemType.DRAM
    return all(_checked(r, host) for r in plan.reads)


def _checked(read: ShardReads, host: bool) -> bool:
    """Whether `verify_pulled` checks `read`: a read of a whole shard carrying the checksum its
    memory is checked with (WSUM-64 in device memory; CRC-32 or WSUM-64 in host memory)."""
    return read.complete and (read.sum64 is not None or (host and read.crc32 is not None))
