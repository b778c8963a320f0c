"""Which bytes of a pull's destination are valid, by the source that delivered them, and how
far they run in order from its first byte (what a serving receiver publishes as filled).

A pipelined pull (`pipelined.PipelinedPull`) adds what lands, drops what a failed source
delivered, and runs again for the rest; the alignment gaps between the plan's targets count as
filled, so the prefix runs over them.
"""

from __future__ import annotations

import numpy as np

from refit_sidecar.core.intervals import Intervals
from refit_sidecar.core.plan import PullPlan


class Filled:
    """Which bytes of the destination are valid, and how far they run in order from byte 0."""

    _gaps: tuple[object, Intervals] | None = None
    """The alignment gaps of the last layout seen, by its targets (the same object for every
    version of a layout)."""

    def __init__(self, plan: PullPlan) -> None:
        self.nbytes = plan.nbytes
        cached = Filled._gaps
        if cached is None or cached[0] is not plan.targets:
            gaps = Intervals([(0, plan.nbytes)])
            for t in plan.targets:
                gaps.remove(t.offset, t.offset + t.nbytes)
            cached = Filled._gaps = (plan.targets, gaps)
        self.valid = cached[1].copy()
        self.by_source: dict[str, Intervals] = {}
        self.published = 0
        """The largest prefix published so far (it never shrinks)."""
        self.started: float | None = None
        """Wall-clock time (time.time()) of the first read posted, over every run."""

    def add(self, source: str, ranges: np.ndarray) -> None:
        """`ranges` landed from `source`: theirs now, whoever delivered them before (a run
        after a fallback reads again the chunks an earlier run filled only in part)."""
        mine = self.by_source.setdefault(source, Intervals())
        others = [r for s, r in self.by_source.items() if s != source]
        for start, length in ranges:
            begin, end = int(start), int(start + length)
            for theirs in others:
                theirs.remove(begin, end)
            self.valid.add(begin, end)
            mine.add(begin, end)

    def bytes_by_source(self) -> dict[str, int]:
        """Valid bytes per source that delivered them last (runs that failed later
        included): they add up to the bytes read."""
        totals = {source: ranges.total for source, ranges in self.by_source.items()}
        return {source: total for source, total in totals.items() if total}

    def drop(self, source: str) -> bool:
        """Forget every byte `source` delivered; True when some of it was already published
        (readers of this copy may hold it)."""
        mine = self.by_source.pop(source, None)
        if mine is None:
            return False
        exposed = any(start < self.published for start, _ in mine)
        for start, end in mine:
            self.valid.remove(start, end)
        return exposed

    @property
    def complete(self) -> bool:
        return self.valid.covers(0, self.nbytes)

    def prefix(self) -> int:
        return self.valid.prefix()
