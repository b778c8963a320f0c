"""Who a receiver reads a version from: the trainer's ranks, or receivers that hold it (a tree).

Torch-free bookkeeping for the sidecar (no NIXL, no gRPC; clock injected as in registry.py).
Per open version it knows the sources: the trainer's ranks (roots, taken from the manifest, live
while the version is open) and peers, receivers offering the boxes they pull (registered with a
TTL, renewed while they serve). A peer serves while it is still filling its copy: its children
read chunk k once it has chunk k (pipelined forwarding; the progress itself is data plane).

`Tree.assign` answers a receiver's wants with routes: every wanted box is cut into pieces, each
with a primary source and ordered fallbacks. The rules:

- a source feeds at most `max_children` receivers at a time (`max_root_children` for a trainer
  rank); a receiver holds its slots from `assign` to `release`;
- a receiver never reads from itself nor from a peer that reads, transitively, from it;
- among the sources with room that hold some of what is still uncovered, the first in this
  order serves all of it that it holds: same topology domain as the receiver, then the lowest
  pipeline stage (a trainer rank or complete copy is stage 0, a filling peer one more than the
  parents it reads from), then peers before trainer ranks, then fewest children, then earliest
  registered. A receiver with another TP layout than a source reads the intersection of the
  source's boxes with its own, so a want may be served by several sources' pieces.

The trainer's ranks are stage 0, so they take the first receivers and are then full; everyone
later reads from peers, breadth first, and the tree's depth grows as log_k of the receivers.
Fallbacks per piece: the primary's own parents (the grandparents), then up to
`max_peer_fallbacks` other peers, then the trainer ranks holding any of the piece. They are a
snapshot for fast failover; a receiver whose fallbacks also fail calls `assign` again.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from refit_sidecar.core.errors import UnknownVersion
from refit_sidecar.core.manifest import Box, Manifest
from refit_sidecar.core.plan import Want
from refit_sidecar.core.tree_records import (
    Assignment,
    CopyState,
    Edge,
    HeldForParent,
    NodeInfo,
    NodeKind,
    NoLiveSource,
    NoSourceFree,
    Orphan,
    PullOutcome,
    Receiver,
    Route,
    TreeConfig,
    TreeListing,
    UnknownSource,
)
from refit_sidecar.service.source_order import (
    Ranking,
    Replay,
    Source,
    holdings,
    holdings_key,
    holds_any,
    take,
)
from trainer_refit.errors import InvalidRequest, quoted

__all__ = [
    "Assignment",
    "CopyState",
    "Edge",
    "HeldForParent",
    "NoLiveSource",
    "NoSourceFree",
    "NodeInfo",
    "NodeKind",
    "Orphan",
    "PullOutcome",
    "Receiver",
    "Route",
    "Tree",
    "TreeConfig",
    "TreeListing",
    "UnknownSource",
    "UnknownVersion",
]

log = logging.getLogger(__name__)

_CUTS_KEPT = 4096
_LAYOUTS_KEPT = 4
_ROUTES_KEPT = 256
_Layout = tuple[
    dict[str, tuple[int, ...]], tuple[tuple[str, dict[str, tuple[Box, ...]], bytes], ...]
]
"""A manifest's shapes by tensor, and per agent (sorted) its boxes by tensor and their key."""


@dataclass(eq=False)
class _Pull:
    """A receiver's latest assignment: active until released."""

    domain: str
    fed_by: tuple[str, ...]
    active: Assignment | None
    state: CopyState = CopyState.FILLING


@dataclass(eq=False)
class _Version:
    version: int
    shapes: dict[str, tuple[int, ...]]
    ranking: Ranking
    sources: dict[str, Source] = field(default_factory=dict)
    pulls: dict[str, _Pull] = field(default_factory=dict)
    roots: list[str] = field(default_factory=list)
    """The trainer's ranks (agents), dropped ones included."""
    seq: Iterator[int] = field(default_factory=itertools.count)
    opened_at: float = 0.0
    gone: set[str] = field(default_factory=set)
    """Sources removed from this version (failed, lost, expired, unregistered)."""


class Tree:
    def __init__(self, config: TreeConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._versions: dict[int, _Version] = {}
        self._deadlines: list[tuple[float, int, str]] = []
        """(expiry, version, peer) per registration or renewal; stale entries are skipped."""
        self._caps = {
            NodeKind.PEER: config.max_children,
            NodeKind.TRAINER: config.max_root_children,
        }
        self._cuts: dict[tuple[bytes, bytes], tuple[tuple[tuple[int, Box], ...] | None, bool]] = {}
        """`_cut` by (holdings key, wants key)."""
        self._held: dict[bytes, tuple[dict[str, tuple[Box, ...]], bytes]] = {}
        """`_holdings` by wants key."""
        self._routes: OrderedDict[
            tuple[object, ...], tuple[list[tuple[int, Box]], tuple[Route, ...]]
        ]
        self._routes = OrderedDict()
        """Routes of single-source assignments, by (wants key, the source's holdings key, the
        source, its fallbacks): the pieces they were cut into, and the routes."""
        self._layouts: list[tuple[Manifest, _Layout]] = []
        """`_layout` of the manifests opened last (kept by identity, newest first)."""
        self._parents: dict[str, tuple[int, tuple[str, ...], float]] = {}
        """Each receiver's version, primaries and time of its latest assignment: held for it
        while a later version is young (`TreeConfig.hold_parents_s`), as long as the receiver
        asked within `TreeConfig.peer_ttl_s` (it may skip versions, not stop)."""

    # -- versions and sources -----------------------------------------------------------------

    def open_version(
        self, version: int, manifest: Manifest, *, domains: Mapping[str, str] | None = None
    ) -> None:
        """Makes `version` assignable, its roots the manifest's agents (trainer ranks), each
        holding its shards' boxes; `domains` maps agent names to topology domains."""
        if version in self._versions:
            raise InvalidRequest(f"version {version} is open already", field="version")
        shapes, holds = self._layout(manifest)
        v = _Version(version, shapes, Ranking(self._caps))
        v.opened_at = self._clock()
        for agent, held, key in holds:
            domain = (domains or {}).get(agent, "")
            root = Source(agent, NodeKind.TRAINER, domain, held, next(v.seq), holds_key=key)
            v.sources[agent] = root
            v.roots.append(agent)
            v.ranking.place(root)
        self._versions[version] = v

    def _layout(self, manifest: Manifest) -> _Layout:
        """The shapes and each agent's boxes of `manifest`; the versions of one trainer slot
        share their manifest's layout (the sidecar parses it once), so this is computed once
        per manifest."""
        for known, layout in self._layouts:
            if known is manifest:
                return layout
        holds: dict[str, dict[str, list[Box]]] = {}
        for p in manifest.parameters:
            for shard in p.shards:
                boxes = holds.setdefault(shard.location.agent, {}).setdefault(p.name, [])
                boxes.extend(piece.box for piece in shard.pieces)
        roots = []
        for agent, held in sorted(holds.items()):
            root = {name: tuple(boxes) for name, boxes in held.items()}
            roots.append((agent, root, holdings_key(root)))
        layout = ({p.name: p.shape for p in manifest.parameters}, tuple(roots))
        self._layouts = [(manifest, layout), *self._layouts[: _LAYOUTS_KEPT - 1]]
        return layout

    def retire(self, version: int) -> bool:
        """Forgets `version` (the registry retired it), and the parents of the receivers that
        stopped pulling (none for `peer_ttl_s`); False when it was not open. A receiver that
        skips versions keeps its parents: the tree keeps its shape across the gap."""
        for receiver in [r for r in self._parents if not self._recent(r)]:
            del self._parents[receiver]
        return self._versions.pop(version, None) is not None

    def _recent(self, receiver_id: str) -> bool:
        """`receiver_id` was assigned a version within `peer_ttl_s`."""
        entry = self._parents.get(receiver_id)
        return entry is not None and self._clock() - entry[2] < self.config.peer_ttl_s

    @property
    def versions(self) -> list[int]:
        return sorted(self._versions)

    def register_peer(
        self, version: int, receiver: Receiver, holds: Sequence[Want], *, state: CopyState
    ) -> float:
        """Offers a receiver's copy of `holds` (its wants); returns when the registration
        expires. Registering again renews it and may mark the copy complete."""
        self.expire()
        v = self._version(version)
        self._check(v, holds, "holds")
        held = holdings(holds)
        source = v.sources.get(receiver.receiver_id)
        if source is None:
            source = Source(receiver.receiver_id, NodeKind.PEER, receiver.domain, held, next(v.seq))
            source.state = state
            source.stage = 1
            v.sources[source.source_id] = source
        else:
            self._check_same(v, source, held)
            if source.state is CopyState.COMPLETE and state is CopyState.FILLING:
                raise InvalidRequest(
                    f"peer {quoted(source.source_id)} already holds a complete copy of version "
                    f"{version}",
                    field="state",
                )
            source.state = state
        v.ranking.place(source)
        return self._renew(v, source)

    def renew(self, version: int, source_id: str) -> float:
        """Extends a peer's registration by the TTL; returns its new expiry."""
        source = self._source(version, source_id)
        if source.kind is NodeKind.TRAINER:
            raise InvalidRequest(f"{quoted(source_id)} is a trainer rank: it does not expire")
        return self._renew(self._versions[version], source)

    def unregister(self, version: int, source_id: str) -> tuple[Orphan, ...]:
        """A peer stops serving `version` (it reuses its staging, or closes)."""
        self._source(version, source_id)
        self._not_a_root(self._versions[version], source_id)
        return self._remove(self._versions[version], source_id)

    def drop(self, source_id: str) -> tuple[Orphan, ...]:
        """`source_id` died: gone from every version, as a source and as a receiver."""
        orphans: list[Orphan] = []
        for v in self._versions.values():
            orphans += self._remove(v, source_id)
        self._parents.pop(source_id, None)
        for receiver, (_, parents, _) in list(self._parents.items()):
            if source_id in parents:
                del self._parents[receiver]
        return tuple(orphans)

    def expire(self) -> tuple[Orphan, ...]:
        """Drops the peers whose registration ran out; every other call does this first."""
        now, orphans = self._clock(), list[Orphan]()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, version, source_id = heapq.heappop(self._deadlines)
            v = self._versions.get(version)
            s = v.sources.get(source_id) if v else None
            if v and s and s.expires_at is not None and s.expires_at <= now:
                log.info("version %d: peer %r expired", version, source_id)
                orphans += self._remove(v, source_id)
        return tuple(orphans)

    def _renew(self, v: _Version, source: Source) -> float:
        source.expires_at = self._clock() + self.config.peer_ttl_s
        heapq.heappush(self._deadlines, (source.expires_at, v.version, source.source_id))
        return source.expires_at

    # -- pulls ----------------------------------------------------------------------------------

    def assign(
        self,
        version: int,
        receiver: Receiver,
        wants: Sequence[Want],
        *,
        serve: bool = True,
        wants_key: bytes = b"",
    ) -> Assignment:
        """Sources for `wants`, holding one child slot per primary until `release`. With
        `serve`, the receiver becomes a filling peer for its wants at once. Assigning a
        receiver again (its parent failed) replaces its previous assignment, whose slots are
        released even when no source is free for the new one.

        `wants_key`: a digest of `wants` the caller checked them under (its wants are then
        taken as checked), so that how a source's holdings cut them is computed once for
        every version: a receiver asks with the same wants each time."""
        self.expire()
        v = self._version(version)
        if not wants or not wants_key:
            self._check(v, wants, "wants")
        rid = receiver.receiver_id
        self._not_a_root(v, rid)
        held = self._holdings(wants, wants_key)
        own = v.sources.get(rid)
        if own is not None:
            self._check_same(v, own, held[0])
        self._end_pull(v, rid)
        excluded = {rid, *self._descendants(v, rid)}
        prefer, reserved = self._held_parents(v, rid, excluded)
        try:
            pieces = self._choose(
                v, receiver.domain, wants, excluded, wants_key, prefer=prefer, reserved=reserved
            )
        except NoSourceFree as e:
            if not reserved:
                raise
            until = v.opened_at + self.config.hold_parents_s
            raise HeldForParent(f"{e} (some slots are held for receivers yet to ask)", until) from e
        primaries = tuple(dict.fromkeys(p for _, _, p in pieces))
        self._parents[rid] = (version, primaries, self._clock())
        for p in primaries:
            v.sources[p].children.add(rid)
            v.ranking.place(v.sources[p])
        order = Replay(v.ranking.ordered(receiver.domain, with_room=False))
        roots = sorted(
            (v.sources[r] for r in v.roots if r in v.sources),
            key=lambda s: (s.domain != receiver.domain, len(s.children), s.seq),
        )
        # A primary's own subtree stalls with it: no fallback comes from there.
        avoid = {p: excluded | self._descendants(v, p) for p in primaries}
        known: dict[str, bool | None] = {}

        def share(source_id: str) -> bool | None:
            if source_id not in known:
                known[source_id] = self._share(v.sources[source_id], wants, wants_key)
            return known[source_id]

        # Where every source a fallback could come from holds all the wants (one layout), the
        # fallbacks are the same for every piece of a primary: found once.
        same = {
            p: self._uniform_fallbacks(
                v, primary=p, excluded=avoid[p], order=order, roots=roots, share=share
            )
            for p in primaries
        }
        memo_key = None
        if len(primaries) == 1 and wants_key and same[primaries[0]] is not None:
            # The usual case: one source holds everything, with one fallback list. A
            # receiver gets the same routes (the same object) while these repeat, so what is
            # built from them (a reply) is found by identity.
            p = primaries[0]
            memo_key = (wants_key, v.sources[p].holds_key, p, same[p])
            memo = self._routes.get(memo_key)
            if memo is not None and [(i, b) for i, b, _ in pieces] == memo[0]:
                self._routes.move_to_end(memo_key)
                routes = memo[1]
                memo_key = None
            else:
                routes = None
        else:
            routes = None
        if routes is None:
            routes = tuple(
                Route(
                    wants[i].name,
                    box,
                    p,
                    self._fallbacks(
                        v,
                        wants[i].name,
                        box,
                        primary=p,
                        excluded=avoid[p],
                        order=order,
                        roots=roots,
                        whole=lambda s: share(s) is True,
                    )
                    if (fallbacks := same[p]) is None
                    else fallbacks,
                )
                for i, box, p in pieces
            )
        if memo_key is not None:
            self._routes[memo_key] = ([(i, b) for i, b, _ in pieces], routes)
            while len(self._routes) > _ROUTES_KEPT:
                self._routes.popitem(last=False)
        assignment = Assignment(version, rid, routes)
        v.pulls[rid] = _Pull(receiver.domain, primaries, assignment)
        if own is None and serve:
            own = Source(
                rid, NodeKind.PEER, receiver.domain, held[0], next(v.seq), holds_key=held[1]
            )
            v.sources[rid] = own
        if own is not None:
            own.state = CopyState.FILLING
            own.stage = 1 + max(self._stage(v.sources[p]) for p in primaries)
            self._renew(v, own)
            v.ranking.place(own)
        log.debug("version %d: %r reads from %s", version, rid, list(primaries))
        return assignment

    def release(self, version: int, receiver_id: str, outcome: PullOutcome) -> tuple[Orphan, ...]:
        """The receiver's pull ended: its child slots are free. A serving receiver's copy
        becomes complete, or, when the pull failed, stops being a source. Releasing again
        changes nothing."""
        self.expire()
        v = self._version(version)
        self._not_a_root(v, receiver_id)
        self._end_pull(v, receiver_id)
        pull = v.pulls.get(receiver_id)
        if outcome is PullOutcome.FAILED:
            v.pulls.pop(receiver_id, None)
            return self._remove(v, receiver_id)
        if pull is not None:
            pull.state = CopyState.COMPLETE
        source = v.sources.get(receiver_id)
        if source is not None and source.kind is NodeKind.PEER:
            source.state = CopyState.COMPLETE
            self._renew(v, source)
            v.ranking.place(source)
        return ()

    def readers(self, version: int, source_id: str) -> tuple[str, ...]:
        """The receivers reading from `source_id` now (their active assignment names it as a
        primary), sorted: what a peer that wants to reuse its copy's memory waits for."""
        self.expire()
        v = self._version(version)
        source = v.sources.get(source_id)
        if source is not None:  # a live source's children are exactly those pulls
            return tuple(sorted(source.children))
        return tuple(
            sorted(
                rid
                for rid, pull in v.pulls.items()
                if pull.active is not None and source_id in pull.active.parents
            )
        )

    def peer_expiry(self, version: int, source_id: str) -> float | None:
        """When `source_id`'s registration as a peer of `version` ends; None when it does
        not serve that version (no listing built: GetSources asks on every call)."""
        self.expire()
        source = self._version(version).sources.get(source_id)
        if source is None or source.kind is not NodeKind.PEER:
            return None
        return source.expires_at

    def tree(self, version: int) -> TreeListing:
        self.expire()
        v = self._version(version)
        depths = self._depths(v)
        nodes = []
        for node_id in set(v.sources) | set(v.pulls):
            source, pull = v.sources.get(node_id), v.pulls.get(node_id)
            if source is not None:
                info = NodeInfo(
                    node_id,
                    source.kind,
                    source.domain,
                    source.state,
                    depths[node_id],
                    len(source.children),
                    source.expires_at,
                )
            else:
                assert pull is not None
                info = NodeInfo(
                    node_id,
                    NodeKind.RECEIVER,
                    pull.domain,
                    pull.state,
                    depths[node_id],
                    0,
                    None,
                )
            nodes.append(info)
        edges = [
            Edge(parent, child, pull.active is not None)
            for child, pull in v.pulls.items()
            for parent in pull.fed_by
            if parent in v.sources
        ]
        return TreeListing(
            version,
            tuple(sorted(nodes, key=lambda n: (n.depth, n.node_id))),
            tuple(sorted(edges, key=lambda e: (e.child, e.parent))),
        )

    # -- internals ------------------------------------------------------------------------------

    def _version(self, version: int) -> _Version:
        v = self._versions.get(version)
        if v is None:
            raise UnknownVersion(
                f"version {version} has no source tree; open versions: {self.versions}"
            )
        return v

    def _source(self, version: int, source_id: str) -> Source:
        self.expire()
        source = self._version(version).sources.get(source_id)
        if source is None:
            raise UnknownSource(
                f"{quoted(source_id)} is not a source of version {version} (never registered, "
                "unregistered, expired or dropped)"
            )
        return source

    def _check(self, v: _Version, wants: Sequence[Want], field_name: str) -> None:
        if not wants:
            raise InvalidRequest(f"no {field_name} given for version {v.version}", field=field_name)
        for want in wants:
            shape = v.shapes.get(want.name)
            if shape is None:
                raise InvalidRequest(
                    f"{quoted(want.name)} is not a parameter of version {v.version}",
                    field=field_name,
                )
            if not want.box.within(shape):
                raise InvalidRequest(
                    f"{want.name}: box {want.box.ranges} is outside shape {shape}", field=field_name
                )

    @staticmethod
    def _not_a_root(v: _Version, node_id: str) -> None:
        if node_id in v.roots:
            raise InvalidRequest(
                f"{quoted(node_id)} is a trainer rank of version {v.version}, not a receiver"
            )

    @staticmethod
    def _check_same(v: _Version, source: Source, held: dict[str, tuple[Box, ...]]) -> None:
        if source.holds != held:
            raise InvalidRequest(
                f"peer {quoted(source.source_id)} holds other boxes of version {v.version}; "
                "unregister it before it serves another layout"
            )

    @staticmethod
    def _depths(v: _Version) -> dict[str, int]:
        """Depth of every source and receiver: 0 for a trainer rank, else 1 + the deepest
        live parent of its last pull (1 without one). Iterative: a chain may be long."""
        depths: dict[str, int] = {}

        def parents(node: str) -> list[str]:
            pull = v.pulls.get(node)
            return [p for p in (pull.fed_by if pull else ()) if p in v.sources]

        for start in itertools.chain(v.sources, v.pulls):
            stack, on_path = [start], set()
            while stack:
                node = stack[-1]
                if node in depths:
                    stack.pop()
                    continue
                source = v.sources.get(node)
                if source is not None and source.kind is NodeKind.TRAINER:
                    depths[node] = 0
                    continue
                pending = [p for p in parents(node) if p not in depths and p not in on_path]
                if pending and node not in on_path:
                    on_path.add(node)
                    stack += pending
                    continue
                depths[node] = 1 + max((depths.get(p, 0) for p in parents(node)), default=0)
                on_path.discard(node)
        return depths

    def _stage(self, source: Source) -> int:
        return 0 if source.state is CopyState.COMPLETE else source.stage

    def _descendants(self, v: _Version, root: str) -> set[str]:
        """The sources reading from `root`, directly or through others, now."""
        out: set[str] = set()
        frontier = [root]
        while frontier:
            source = v.sources.get(frontier.pop())
            for child in v.sources.keys() & source.children if source else ():
                if child not in out:
                    out.add(child)
                    frontier.append(child)
        return out

    def _holdings(
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

    def _cut(
        self, source: Source, wants: Sequence[Want], wants_key: bytes
    ) -> tuple[tuple[tuple[int, Box], ...] | None, bool]:
        """(all of `wants` as `source` holds it, in pieces (want index, box) in want order,
        or None when it does not hold all of it; whether it holds none of it). Cached by
        (holdings, wants) when the wants have a key."""
        key = (source.holds_key, wants_key)
        if wants_key and key in self._cuts:
            return self._cuts[key]
        taken, left = take(
            [(i, w.box) for i, w in enumerate(wants)], [w.name for w in wants], source.holds
        )
        cut = None if left else tuple(sorted(taken, key=lambda p: (p[0], p[1].start)))
        if wants_key:
            if len(self._cuts) >= _CUTS_KEPT:
                self._cuts.clear()
            self._cuts[key] = (cut, not taken)
        return cut, not taken

    def _share(self, source: Source, wants: Sequence[Want], wants_key: bytes) -> bool | None:
        """Whether `source` holds all of `wants` (True) or none of it (False); None when it
        holds some, or the wants have no key (cutting then costs more than it saves)."""
        if not wants_key:
            return None
        cut, none = self._cut(source, wants, wants_key)
        return True if cut is not None else False if none else None

    def _choose(
        self,
        v: _Version,
        domain: str,
        wants: Sequence[Want],
        excluded: set[str],
        wants_key: bytes = b"",
        *,
        prefer: Sequence[str] = (),
        reserved: Mapping[str, int] | None = None,
    ) -> list[tuple[int, Box, str]]:
        """(want index, piece, primary), in want order: the best source with room first
        takes all it holds of what is left; `prefer` (sources with room) come first, and a
        source's slots `reserved` for other receivers are not room."""
        left = [(i, w.box) for i, w in enumerate(wants)]
        names = [w.name for w in wants]
        pieces: list[tuple[int, Box, str]] = []
        held = reserved or {}

        def room(source_id: str) -> bool:
            source = v.sources[source_id]
            return len(source.children) + held.get(source_id, 0) < self._caps[source.kind]

        chosen = [p for p in prefer if p in v.sources and p not in excluded and room(p)]
        ranked = (s for s in v.ranking.ordered(domain, with_room=True) if s not in chosen)
        for source_id in itertools.chain(chosen, ranked):
            if source_id in excluded or not room(source_id):
                continue
            if not pieces and wants_key:
                # The usual case: the first source holds everything (a peer of the same
                # layout, a trainer of one rank), cut as it was for an earlier version.
                cut, _ = self._cut(v.sources[source_id], wants, wants_key)
                if cut is not None:
                    return [(i, box, source_id) for i, box in cut]
            taken, left = take(left, names, v.sources[source_id].holds)
            pieces += [(i, box, source_id) for i, box in taken]
            if not left:
                return sorted(pieces, key=lambda p: (p[0], p[1].start))
        i, box = left[0]
        name = wants[i].name
        holders = [
            s.source_id
            for s in v.sources.values()
            if s.source_id not in excluded and holds_any(s.holds, name, box)
        ]
        if holders:
            raise NoSourceFree(
                f"version {v.version}: {name} {box.ranges} is held only by sources that feed "
                f"their maximum of children ({len(holders)}: {holders[:4]}); retry after a pull "
                "ends"
            )
        raise NoLiveSource(
            f"version {v.version}: no live source outside the receiver's own subtree holds "
            f"{name} {box.ranges}"
        )

    def _held_parents(
        self, v: _Version, receiver_id: str, excluded: set[str]
    ) -> tuple[tuple[str, ...], dict[str, int]]:
        """While `v` is young: the receiver's previous parents (NoSourceFree while one of them,
        alive, has not asked for `v` yet), and the child slots held for the other receivers
        that have not asked yet, by parent."""
        if self._clock() - v.opened_at >= self.config.hold_parents_s:
            return (), {}
        before, mine, _ = self._parents.get(receiver_id, (-1, (), 0.0))
        if before >= v.version or not self._recent(receiver_id):
            mine = ()  # assigned for this version already (a fallback), or it had stopped
        late = [
            p
            for p in mine
            if p not in v.sources
            and p not in excluded
            and p not in v.gone
            and (self._recent(p) or any(p in w.sources for w in self._versions.values()))
        ]
        if late:
            raise HeldForParent(
                f"version {v.version}: {quoted(receiver_id)} waits for its previous parent "
                f"{quoted(late[0])}, which has not asked for this version yet",
                v.opened_at + self.config.hold_parents_s,
            )
        reserved: dict[str, int] = {}
        for other, (then, parents, _) in self._parents.items():
            if (
                other != receiver_id
                and then < v.version
                and other not in v.pulls
                and other not in v.gone
                and self._recent(other)
            ):
                for p in parents:
                    reserved[p] = reserved.get(p, 0) + 1
        # Holds can claim more of a parent than it has: a receiver that finished early frees
        # its slot, another takes it, and both remember that parent. This receiver is one of
        # the claimants: it asked first, so one slot is its own.
        for p in mine:
            source = v.sources.get(p)
            if source is not None and p in reserved:
                reserved[p] = min(reserved[p], self._caps[source.kind] - 1)
        return mine, reserved

    def _fallbacks(
        self,
        v: _Version,
        name: str,
        box: Box,
        *,
        primary: str,
        excluded: set[str],
        order: Replay,
        roots: list[Source],
        whole: Callable[[str], bool] = lambda s: False,
    ) -> tuple[str, ...]:
        """`whole(source_id)`: the source holds every want (so any piece of them)."""

        def usable(s: Source | None) -> bool:
            return (
                s is not None
                and s.source_id != primary
                and s.source_id not in excluded
                and (whole(s.source_id) or holds_any(s.holds, name, box))
            )

        pull = v.pulls.get(primary)
        out = [g for g in (pull.fed_by if pull else ()) if usable(v.sources.get(g))]
        peers = 0
        for source_id in order:
            if peers >= self.config.max_peer_fallbacks:
                break
            source = v.sources[source_id]
            if source.kind is NodeKind.PEER and source_id not in out and usable(source):
                out.append(source_id)
                peers += 1
        out += [r.source_id for r in roots if r.source_id not in out and usable(r)]
        return tuple(out)

    def _uniform_fallbacks(
        self,
        v: _Version,
        *,
        primary: str,
        excluded: set[str],
        order: Replay,
        roots: list[Source],
        share: Callable[[str], bool | None],
    ) -> tuple[str, ...] | None:
        """`_fallbacks` of any piece of `primary`'s, when every source it would consider holds
        all the wants or none of them (`share`); None when one holds some (the pieces are then
        looked at one by one)."""

        def candidate(s: Source | None) -> bool | None:
            """Usable for every piece (True), for none (False), or it depends (None)."""
            if s is None or s.source_id == primary or s.source_id in excluded:
                return False
            return share(s.source_id)

        out: list[str] = []
        pull = v.pulls.get(primary)
        for g in pull.fed_by if pull else ():
            use = candidate(v.sources.get(g))
            if use is None:
                return None
            if use:
                out.append(g)
        peers = 0
        for source_id in order:
            if peers >= self.config.max_peer_fallbacks:
                break
            source = v.sources[source_id]
            if source.kind is not NodeKind.PEER or source_id in out:
                continue
            use = candidate(source)
            if use is None:
                return None
            if use:
                out.append(source_id)
                peers += 1
        for root in roots:
            if root.source_id in out:
                continue
            use = candidate(root)
            if use is None:
                return None
            if use:
                out.append(root.source_id)
        return tuple(out)

    def _end_pull(self, v: _Version, receiver_id: str) -> None:
        pull = v.pulls.get(receiver_id)
        if pull is None or pull.active is None:
            return
        for parent in pull.active.parents:
            source = v.sources.get(parent)
            if source is not None:
                source.children.discard(receiver_id)
                v.ranking.place(source)
        pull.active = None

    def _remove(self, v: _Version, source_id: str) -> tuple[Orphan, ...]:
        self._end_pull(v, source_id)
        v.pulls.pop(source_id, None)
        source = v.sources.pop(source_id, None)
        if source is None:
            return ()
        v.gone.add(source_id)
        v.ranking.remove(source_id)
        orphans = tuple(Orphan(v.version, source_id, c) for c in sorted(source.children))
        if orphans:
            log.info(
                "version %d: source %r left; %s fall back", v.version, source_id, list(orphans)
            )
        return orphans
