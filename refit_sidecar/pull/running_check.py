"""Checking a pull against the trainer's checksums while it runs (docs/fanout.md, step 6).

A pull into device memory checks the WSUM-64 of every trainer shard it read whole, and sums the
pieces of every shard it read part of (the engine's workers add those up: `partial_sums`,
`partial`). Done after the
last byte lands, the check is a tail every refit waits for, and in a tree every level waits for its
own. `RunningCheck` starts the sums of a part of the shards as soon as the destination holds every
byte of them (the pull fills it in order: `advance(prefix)` with the bytes filled from its start),
on a stream of its own, so they run while later chunks are in flight; `finish` starts what is left,
waits for all of them and compares. When bytes may be read again (a source failed and another one
delivers them), `restart` drops what was started, and `finish` checks everything; so does a part
that could not be started (its error is logged, never raised into the pull's loop, which has reads
in flight).

The parts are cut from the layout alone, never from when bytes landed: consecutive shards (in
the order they end) until a part holds `part_bytes`. A pull of the same layout cuts the same
parts, so each part's block tables are on the GPU from the pull before (`device_sums`). Parts
cut where the prefix happened to grow differed from pull to pull; each new part uploaded its
tables, a copy queued behind the peers' 256 MiB copies on the GPU's copy engines, which
delayed the part's start.

Host memory is checked (and its partial reads summed) in `finish`, as `verify.verify_pulled`
does.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from refit_sidecar.core.manifest import MemType
from refit_sidecar.core.plan import Checksums, PullPlan, with_read_checksums
from refit_sidecar.integrity.partial_sums import PartialSums
from refit_sidecar.integrity.verify import check_pulled
from refit_sidecar.memory.region import Region
from refit_sidecar.pull.chunking import chunk_bounds

log = logging.getLogger(__name__)

DEFAULT_PART_BYTES = 256 << 20
"""Bytes per part (the last may hold fewer): each part started costs a few kernel launches,
and the last is summed after the pull's last byte."""


@dataclass(frozen=True)
class _Part:
    end: int
    """Where the last byte of its shards lies in the destination, plus one."""
    reads: list[int]
    """Indices into the plan's reads."""


class RunningCheck:
    """One pull's check against the trainer's checksums, started as the destination fills."""

    def __init__(
        self,
        plan: PullPlan,
        dest: Region,
        *,
        part_bytes: int = DEFAULT_PART_BYTES,
        taper: int = 0,
    ) -> None:
        if part_bytes < 1:
            raise ValueError(f"a part needs at least one byte, got {part_bytes}")
        self._plan = plan
        self._dest = dest
        self._part_bytes = part_bytes
        self._taper = taper
        self._parts: list[_Part] | None = None if dest.mem_type is not MemType.DRAM else []
        self._next = 0
        """Parts started so far."""
        self._sums: Any = None
        """The parts' sums (`device_sums.PartedSums`), from the first part started."""
        self._stream: Any = None
        self._device: Any = None
        self._whole = False
        self.partial: PartialSums | None = None
        """After `finish`: the WSUM-64s of the reads of parts of shards, which no receiver
        checks alone (`partial_sums`)."""

    @property
    def runs_ahead(self) -> bool:
        """Whether `advance` starts anything (device memory); host memory is checked in
        `finish` only."""
        return self._dest.mem_type is not MemType.DRAM

    @property
    def started(self) -> int:
        """Parts started so far."""
        return self._next

    def advance(self, prefix: int) -> None:
        """The destination holds every byte before `prefix`: start the parts that lie there."""
        if self._whole:
            return
        try:
            parts = self._cut()
            stop = self._next
            while stop < len(parts) and parts[stop].end <= prefix:
                stop += 1
            if stop > self._next:
                self._start(stop)
        except Exception:
            log.warning(
                "a running check could not start; the pull is checked at its end", exc_info=True
            )
            self.restart()

    def restart(self) -> None:
        """Bytes counted as landed may be read again: what was started no longer counts, and
        `finish` checks every shard."""
        self._sums = None
        self._whole = True

    def finish(self, published: Sequence[Checksums] | None = None) -> int:
        """Checks what is left and waits for every part; returns how many shards were checked.
        ChecksumMismatch names the first that differs. The sums of the reads of parts of
        shards are then in `partial`. `published`: each read's checksums, to
        compare with when they came after the check started (the plan's own then only said
        which reads are checked)."""
        if published is not None and len(published) != len(self._plan.reads):
            raise ValueError(
                f"{len(published)} checksums for the plan's {len(self._plan.reads)} reads"
            )
        parts = self._cut()
        if not parts or self._whole:
            plan = self._plan if published is None else with_read_checksums(self._plan, published)
            count, self.partial = check_pulled(plan, self._dest)
            return count
        if self._next < len(parts):
            self._start(len(parts))
        with self._on_stream():
            sums = None if published is None else [c.sum64 for c in published]
            count = self._sums.check(sums)
            self.partial = self._sums.partial_sums(sums)
        return count

    def _cut(self) -> list[_Part]:
        if self._parts is None:
            self._parts = _parts(self._plan, self._part_bytes, self._taper)
        return self._parts

    def _start(self, stop: int) -> None:
        """Starts the parts not started yet up to `stop` (exclusive), together: the requests
        in flight land together, and so do the parts they fill."""
        from refit_sidecar.integrity.device_sums import PartedSums  # device memory: torch is there

        with self._on_stream():
            if self._sums is None:
                parts = self._cut()
                self._sums = PartedSums(self._plan, self._dest, [p.reads for p in parts])
            self._sums.start(self._next, stop)
        self._next = stop

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        """On a GPU, a stream of the check's own: its sums wait for nothing else queued (the
        legacy default stream would wait for the copies in flight). Of high priority: the
        GPU schedules its blocks ahead of other kernels' (another receiver's install on a
        shared GPU), since a refit waits for the last part's sums."""
        import torch

        from refit_sidecar.integrity.device_sums import region_tensor

        if self._device is None:
            self._device = region_tensor(self._dest).device
        device = self._device
        if device.type != "cuda":
            yield
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device, priority=-1)
        with torch.cuda.stream(self._stream):
            yield


def _parts(plan: PullPlan, part_bytes: int, taper: int = 0) -> list[_Part]:
    """The reads a device check sums (carrying a WSUM-64: compared when read whole, handed to
    the engine's workers when of part of a shard), in order of where they end in the
    destination, cut into parts of `part_bytes` or more (the last may hold less). With
    `taper`, a part also ends at the read that takes the running total of their bytes past one
    of `chunking.chunk_bounds(total, part_bytes, taper)`: parts halve towards the end, as
    tapered requests do, so the last part's sums are small."""
    ends = []
    for i, shard in enumerate(plan.reads):
        if shard.sum64 is not None and len(shard.lengths):
            end = int((shard.dest_offsets + shard.lengths).max())
            ends.append((end, int(shard.lengths.sum()), i))
    ends.sort()
    parts: list[_Part] = []
    taken: list[int] = []
    held = total = 0
    bounds = iter(())
    if taper:
        bounds = iter(chunk_bounds(sum(n for _, n, _ in ends), part_bytes, taper).tolist())
    bound = next(bounds, None)
    for end, nbytes, i in ends:
        taken.append(i)
        held += nbytes
        total += nbytes
        crossed = bound is not None and total >= bound
        while bound is not None and total >= bound:
            bound = next(bounds, None)
        if held >= part_bytes or crossed:
            parts.append(_Part(end, taken))
            taken, held = [], 0
    if taken:
        parts.append(_Part(ends[-1][0], taken))
    return parts
