"""Disjoint half-open byte ranges: which parts of a destination buffer hold valid bytes."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator


class Intervals:
    """A set of disjoint, non-adjacent [start, end) ranges, kept sorted and merged."""

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        for start, end in ranges:
            self.add(start, end)

    def copy(self) -> Intervals:
        other = Intervals()
        other._starts = list(self._starts)
        other._ends = list(self._ends)
        return other

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(zip(self._starts, self._ends, strict=True))

    def __len__(self) -> int:
        return len(self._starts)

    @property
    def total(self) -> int:
        return sum(e - s for s, e in self)

    def add(self, start: int, end: int) -> None:
        if end <= start:
            return
        # Merge with every range that overlaps or touches [start, end).
        lo = bisect.bisect_left(self._ends, start)
        hi = bisect.bisect_right(self._starts, end)
        if lo < hi:
            start = min(start, self._starts[lo])
            end = max(end, self._ends[hi - 1])
        self._starts[lo:hi] = [start]
        self._ends[lo:hi] = [end]

    def remove(self, start: int, end: int) -> None:
        if end <= start:
            return
        lo = bisect.bisect_right(self._ends, start)
        hi = bisect.bisect_left(self._starts, end)
        keep: list[tuple[int, int]] = []
        for s, e in zip(self._starts[lo:hi], self._ends[lo:hi], strict=True):
            if s < start:
                keep.append((s, start))
            if e > end:
                keep.append((end, e))
        self._starts[lo:hi] = [s for s, _ in keep]
        self._ends[lo:hi] = [e for _, e in keep]

    def covers(self, start: int, end: int) -> bool:
        """Whether [start, end) lies inside one range."""
        if end <= start:
            return True
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and self._ends[i] >= end

    def prefix(self) -> int:
        """The end of the range starting at 0 (0 when 0 is not covered)."""
        return self._ends[0] if self._starts and self._starts[0] == 0 else 0
