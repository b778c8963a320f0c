"""How the source tree ranks and cuts: a version's sources in preference order, and the
pieces of wanted boxes a source holds (box subtraction). Internal to
`refit_sidecar.service.tree`."""

from __future__ import annotations

import bisect
import hashlib
import heapq
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from refit_sidecar.core.manifest import Box
from refit_sidecar.core.plan import Want
from refit_sidecar.core.tree_records import CopyState, NodeKind


@dataclass(eq=False)
class Source:
    source_id: str
    kind: NodeKind
    domain: str
    holds: dict[str, tuple[Box, ...]]
    seq: int
    state: CopyState = CopyState.COMPLETE
    stage: int = 0
    """Pipeline stage when filling: 1 + the largest stage of the parents it reads from."""
    expires_at: float | None = None
    children: set[str] = field(default_factory=set)
    holds_key: bytes = b""
    """`holdings_key(holds)`: sources holding the same boxes share cached cuts."""

    def __post_init__(self) -> None:
        if not self.holds_key:
            self.holds_key = holdings_key(self.holds)


_Key = tuple[str, int, int, int]
"""(domain, stage, kind: 0 peer / 1 trainer rank, children)."""


class Ranking:
    """A version's sources in preference order for a domain, without sorting them per request:
    buckets of equal (domain, stage, kind, children), each a heap by registration order whose
    stale entries (the source moved or left) are skipped; per domain the bucket keys in order,
    all of them and those with room apart."""

    def __init__(self, caps: Mapping[NodeKind, int]) -> None:
        self._caps = caps
        self._buckets: dict[_Key, list[tuple[int, str]]] = {}
        self._where: dict[str, _Key] = {}
        self._keys: dict[str, list[_Key]] = {}
        self._room: dict[str, list[_Key]] = {}

    def place(self, source: Source) -> None:
        stage = 0 if source.state is CopyState.COMPLETE else source.stage
        kind = 1 if source.kind is NodeKind.TRAINER else 0
        key = (source.domain, stage, kind, len(source.children))
        if self._where.get(source.source_id) == key:
            return
        self._where[source.source_id] = key
        heap = self._buckets.get(key)
        if heap is None:
            heap = self._buckets[key] = []
            bisect.insort(self._keys.setdefault(key[0], []), key)
            if key[3] < self._caps[source.kind]:
                bisect.insort(self._room.setdefault(key[0], []), key)
        heapq.heappush(heap, (source.seq, source.source_id))

    def remove(self, source_id: str) -> None:
        self._where.pop(source_id, None)

    def ordered(self, domain: str, *, with_room: bool) -> Iterator[str]:
        """Source ids, best first for a receiver of `domain`: same domain, lowest stage,
        peers before trainer ranks, fewest children, earliest registered."""
        index = self._room if with_room else self._keys
        others = [keys for d, keys in index.items() if d != domain]
        for key in itertools.chain(
            list(index.get(domain, ())), list(heapq.merge(*others, key=lambda k: k[1:]))
        ):
            heap = self._buckets.get(key)
            while heap and self._where.get(heap[0][1]) != key:
                heapq.heappop(heap)
            if not heap:
                self._drop(key)
                continue
            seen: set[str] = set()
            for _, source_id in _in_order(heap):
                if source_id not in seen and self._where.get(source_id) == key:
                    seen.add(source_id)
                    yield source_id

    def _drop(self, key: _Key) -> None:
        if self._buckets.pop(key, None) is None:
            return
        for index in (self._keys, self._room):
            keys = index.get(key[0], [])
            at = bisect.bisect_left(keys, key)
            if at < len(keys) and keys[at] == key:
                del keys[at]


def _in_order(heap: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """A heap's items, smallest first, without sorting or changing it: O(log k) per item."""
    frontier = [(heap[0], 0)] if heap else []
    while frontier:
        item, at = heapq.heappop(frontier)
        yield item
        for child in (2 * at + 1, 2 * at + 2):
            if child < len(heap):
                heapq.heappush(frontier, (heap[child], child))


class Replay:
    """An iterator's items, fetched once and replayed by every iteration."""

    def __init__(self, items: Iterator[str]) -> None:
        self._items = items
        self._seen: list[str] = []

    def __iter__(self) -> Iterator[str]:
        for i in itertools.count():
            if i == len(self._seen):
                item = next(self._items, None)
                if item is None:
                    return
                self._seen.append(item)
            yield self._seen[i]


def holdings(wants: Sequence[Want]) -> dict[str, tuple[Box, ...]]:
    held: dict[str, list[Box]] = {}
    for want in wants:
        held.setdefault(want.name, []).append(want.box)
    return {name: tuple(boxes) for name, boxes in held.items()}


def holdings_key(holds: Mapping[str, tuple[Box, ...]]) -> bytes:
    """A digest of what a source holds: equal for equal holdings."""
    text = repr(sorted((name, [b.ranges for b in boxes]) for name, boxes in holds.items()))
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def subtract(box: Box, hole: Box) -> list[Box]:
    """`box` minus `hole` (a box within it), as disjoint boxes."""
    out = []
    ranges = list(box.ranges)
    for d, ((lo, hi), (h_lo, h_hi)) in enumerate(zip(box.ranges, hole.ranges, strict=True)):
        if lo < h_lo:
            out.append(Box((*ranges[:d], (lo, h_lo), *ranges[d + 1 :])))
        if h_hi < hi:
            out.append(Box((*ranges[:d], (h_hi, hi), *ranges[d + 1 :])))
        ranges[d] = (h_lo, h_hi)
    return out


def holds_any(holds: Mapping[str, tuple[Box, ...]], name: str, box: Box) -> bool:
    """Whether any of `holds[name]` overlaps `box`."""
    return any(
        all(a < d and c < b for (a, b), (c, d) in zip(h.ranges, box.ranges, strict=True))
        for h in holds.get(name, ())
    )


def take(
    left: Sequence[tuple[int, Box]], names: Sequence[str], holds: Mapping[str, tuple[Box, ...]]
) -> tuple[list[tuple[int, Box]], list[tuple[int, Box]]]:
    """(taken, still left): the parts of `left` (index into `names`, box) that `holds` covers,
    and the rest, as disjoint boxes."""
    taken: list[tuple[int, Box]] = []
    still: list[tuple[int, Box]] = []
    for i, box in left:
        rest = [box]
        for hole in holds.get(names[i], ()):
            cut: list[Box] = []
            for part in rest:
                inter = part.intersect(hole)
                if inter is None:
                    cut.append(part)
                else:
                    taken.append((i, inter))
                    cut += subtract(part, inter)
            rest = cut
        still += [(i, part) for part in rest]
    return taken, still


_CUTS_KEPT = 4096


class Cuts:
    """How sources' holdings cut receivers' wants, cached by (holdings key, wants key): a
    receiver asks with the same wants for every version, and sources of one layout share
    holdings, so each cut is computed once."""

    def __init__(self) -> None:
        self._by_keys: dict[tuple[bytes, bytes], tuple[tuple[tuple[int, Box], ...] | None, bool]]
        self._by_keys = {}
        """`cut` by (holdings key, wants key)."""
        self._held: dict[bytes, tuple[dict[str, tuple[Box, ...]], bytes]] = {}
        """`holdings` by wants key."""

    def holdings(
        self, wants: Sequence[Want], wants_key: bytes
    ) -> tuple[dict[str, tuple[Box, ...]], bytes]:
        """What a receiver of `wants` holds once it has them, and its `holdings_key`."""
        cached = self._held.get(wants_key) if wants_key else None
        if cached is None:
            held = holdings(wants)
            cached = (held, holdings_key(held))
            if wants_key:
                if len(self._held) >= _CUTS_KEPT:
                    self._held.clear()
                self._held[wants_key] = cached
        return cached

    def cut(
        self, source: Source, wants: Sequence[Want], wants_key: bytes
    ) -> tuple[tuple[tuple[int, Box], ...] | None, bool]:
        """(all of `wants` as `source` holds it, in pieces (want index, box) in want order,
        or None when it does not hold all of it; whether it holds none of it). Cached by
        (holdings, wants) when the wants have a key."""
        key = (source.holds_key, wants_key)
        if wants_key and key in self._by_keys:
            return self._by_keys[key]
        taken, left = take(
            [(i, w.box) for i, w in enumerate(wants)], [w.name for w in wants], source.holds
        )
        cut = None if left else tuple(sorted(taken, key=lambda p: (p[0], p[1].start)))
        if wants_key:
            if len(self._by_keys) >= _CUTS_KEPT:
                self._by_keys.clear()
            self._by_keys[key] = (cut, not taken)
        return cut, not taken

    def share(self, source: Source, wants: Sequence[Want], wants_key: bytes) -> bool | None:
        """Whether `source` holds all of `wants` (True) or none of it (False); None when it
        holds some, or the wants have no key (cutting then costs more than it saves)."""
        if not wants_key:
            return None
        cut, none = self.cut(source, wants, wants_key)
        return True if cut is not None else False if none else None
