"""Checking a pull against the trainer's checksums while it runs (docs/fanout.md, step 6).

A pull into device memory checks the WSUM-64 of every trainer shard it read whole. Done after
the last byte lands, the check is a tail every refit waits for (about 2 ms for 2 GB on a GPU
that three receivers share), and in a tree every level waits for its own. `RunningCheck`
starts the sums of a part of the shards as soon as the destination holds every byte of them
(the pull fills it in order: `advance(prefix)` with the bytes filled from its start), on a
stream of its own, so they run while later chunks are in flight; `finish` starts what is left,
waits for all of them and compares. When bytes may be read again (a source failed and another
one delivers them), `restart` drops what was started, and `finish` checks everything; so does
a part that could not be started (its error is logged, never raised into the pull's loop, which
has reads in flight).

Each `advance` that finds shards newly whole before the prefix starts them as one part (once
they hold `min_part_bytes`, 16 MiB by default, so a pull of many small chunks does not launch
sums for each): the parts follow where the pull's prefix grows, so a pull whose chunks taper
towards its end (`chunking.chunk_bounds`) leaves only its last small chunk's shards to sum
after the last byte lands. Cut into four parts of equal bytes before, the last part (about
470 MiB of a 1B model) was summed after the last byte on a GPU the other receivers' installs
kept busy: 0.7-2.2 ms a level.

Host memory is checked in `finish`, as `transport.verify_pulled` does.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

from refit_sidecar.manifest import MemType
from refit_sidecar.plan import PullPlan
from refit_sidecar.transport import Region, verify_pulled

log = logging.getLogger(__name__)

_MAX = sys.maxsize

DEFAULT_MIN_PART_BYTES = 16 << 20
"""A part's least bytes (but the last's): each part started costs a few kernel launches."""


class RunningCheck:
    """One pull's check against the trainer's checksums, started as the destination fills."""

    def __init__(
        self, plan: PullPlan, dest: Region, *, min_part_bytes: int = DEFAULT_MIN_PART_BYTES
    ) -> None:
        if min_part_bytes < 0:
            raise ValueError(f"a part's least bytes cannot be negative, got {min_part_bytes}")
        self._plan = plan
        self._dest = dest
        self._min_bytes = min_part_bytes
        self._ends: list[tuple[int, int, int]] | None = (
            None if dest.mem_type is not MemType.DRAM else []
        )
        self._next = 0
        """Shards (in `_ends`) started so far."""
        self._parts = 0
        self._started: list[tuple[Any, list[int]]] = []
        self._stream: Any = None
        self._whole = False

    @property
    def runs_ahead(self) -> bool:
        """Whether `advance` starts anything (device memory); host memory is checked in
        `finish` only."""
        return self._dest.mem_type is not MemType.DRAM

    @property
    def started(self) -> int:
        """Parts started so far."""
        return self._parts

    def advance(self, prefix: int) -> None:
        """The destination holds every byte before `prefix`: start, as one part, the shards
        not started yet that lie there, once they hold `min_part_bytes` or are the last."""
        if self._whole:
            return
        try:
            ends = self._checked()
            upto = bisect.bisect_right(ends, (prefix, _MAX, _MAX), lo=self._next)
            if upto == self._next:
                return
            if upto < len(ends) and sum(n for _, n, _ in ends[self._next : upto]) < self._min_bytes:
                return
            self._start(upto)
        except Exception:
            log.warning(
                "a running check could not start; the pull is checked at its end", exc_info=True
            )
            self.restart()

    def restart(self) -> None:
        """Bytes counted as landed may be read again: what was started no longer counts, and
        `finish` checks every shard."""
        self._started.clear()
        self._whole = True

    def finish(self) -> int:
        """Checks what is left and waits for every part; returns how many shards were checked.
        ChecksumMismatch names the first that differs."""
        ends = self._checked()
        if not ends or self._whole:
            return verify_pulled(self._plan, self._dest)
        if self._next < len(ends):
            self._start(len(ends))
        from refit_sidecar.torch_wsum import check_sums  # device memory: torch is there

        with self._on_stream():
            return check_sums(self._plan, self._started)

    def _checked(self) -> list[tuple[int, int, int]]:
        if self._ends is None:
            self._ends = _checked_ends(self._plan)
        return self._ends

    def _start(self, upto: int) -> None:
        """Starts the shards of `_ends[_next:upto]` as one part."""
        from refit_sidecar.torch_wsum import start_sums

        assert self._ends is not None
        reads = [i for _, _, i in self._ends[self._next : upto]]
        with self._on_stream():
            self._started.append(start_sums(self._plan, self._dest, reads))
        self._next = upto
        self._parts += 1

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        """On a GPU, a stream of the check's own: its sums wait for nothing else queued (the
        legacy default stream would wait for the copies in flight). Of high priority: the
        GPU schedules its blocks ahead of other kernels' (another receiver's install on a
        shared GPU), since a refit waits for the last part's sums."""
        import torch

        from refit_sidecar.torch_wsum import region_tensor

        device = region_tensor(self._dest).device
        if device.type != "cuda":
            yield
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device, priority=-1)
        with torch.cuda.stream(self._stream):
            yield


def _checked_ends(plan: PullPlan) -> list[tuple[int, int, int]]:
    """(where it ends in the destination, bytes, index in the plan's reads) of each read a
    device check covers (read whole, carrying a WSUM-64), in order of where they end."""
    ends = []
    for i, shard in enumerate(plan.reads):
        if shard.complete and shard.sum64 is not None and len(shard.lengths):
            end = int((shard.dest_offsets + shard.lengths).max())
            ends.append((end, int(shard.lengths.sum()), i))
    ends.sort()
    return ends
