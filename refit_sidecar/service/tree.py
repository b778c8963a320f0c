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
from collections.abc import Callable, Mapping, Sequence

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
from refit_sidecar.service.parent_holds import ParentHolds
from refit_sidecar.service.source_order import (
    Cuts,
    Ranking,
    Replay,
    Source,
    holdings,
    holdings_key,
    holds_any,
    take,
)
from refit_sidecar.service.tree_shape import (
    OpenVersion,
    ReceiverPull,
    check_same,
    check_wants,
    descendants,
    fallbacks,
    listing,
    not_a_root,
    uniform_fallbacks,
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

_LAYOUTS_KEPT = 4
_ROUTES_KEPT = 256
_Layout = tuple[
    dict[str, tuple[int, ...]], tuple[tuple[str, dict[str, tuple[Box, ...]], bytes], ...]
]
"""A manifest's shapes by tensor, and per agent (sorted) its boxes by tensor and their key."""


class Tree:
    def __init__(self, config: TreeConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._versions: dict[int, OpenVersion] = {}
        self._deadlines: list[tuple[float, int, str]] = []
        """(expiry, version, peer) per registration or renewal; stale entries are skipped."""
        self._caps = {
            NodeKind.PEER: config.max_children,
            NodeKind.TRAINER: config.max_root_children,
        }
        self._cuts = Cuts()
        """How sources' holdings cut receivers' wants, by their keys."""
        self._routes: OrderedDict[
            tuple[object, ...], tuple[list[tuple[int, Box]], tuple[Route, ...]]
        ]
        self._routes = OrderedDict()
        """Routes of single-source assignments, by (wants key, the source's holdings key, the
        source, its fallbacks): the pieces they were cut into, and the routes."""
        self._layouts: list[tuple[Manifest, _Layout]] = []
        """`_layout` of the manifests opened last (kept by identity, newest first)."""
        self._holds = ParentHolds(config, self._caps, clock)
        """Each receiver's parents, held for it while a later version is young."""

    # -- versions and sources -----------------------------------------------------------------

    def open_version(
        self, version: int, manifest: Manifest, *, domains: Mapping[str, str] | None = None
    ) -> None:
        """Makes `version` assignable, its roots the manifest's agents (trainer ranks), each
        holding its shards' boxes; `domains` maps agent names to topology domains."""
        if version in self._versions:
            raise InvalidRequest(f"version {version} is open already", field="version")
        shapes, holds = self._layout(manifest)
        v = OpenVersion(version, shapes, Ranking(self._caps))
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
        self._holds.forget_stopped()
        return self._versions.pop(version, None) is not None

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
        check_wants(v, holds, "holds")
        held = holdings(holds)
        source = v.sources.get(receiver.receiver_id)
        if source is None:
            source = Source(receiver.receiver_id, NodeKind.PEER, receiver.domain, held, next(v.seq))
            source.state = state
            source.stage = 1
            v.sources[source.source_id] = source
        else:
            check_same(v, source, held)
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
        not_a_root(self._versions[version], source_id)
        return self._remove(self._versions[version], source_id)

    def drop(self, source_id: str) -> tuple[Orphan, ...]:
        """`source_id` died: gone from every version, as a source and as a receiver."""
        orphans: list[Orphan] = []
        for v in self._versions.values():
            orphans += self._remove(v, source_id)
        self._holds.drop(source_id)
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

    def _renew(self, v: OpenVersion, source: Source) -> float:
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
            check_wants(v, wants, "wants")
        rid = receiver.receiver_id
        not_a_root(v, rid)
        held = self._cuts.holdings(wants, wants_key)
        own = v.sources.get(rid)
        if own is not None:
            check_same(v, own, held[0])
        self._end_pull(v, rid)
        excluded = {rid, *descendants(v, rid)}
        prefer, reserved = self._holds.held(v, rid, excluded, self._versions.values())
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
        self._holds.note(rid, version, primaries)
        for p in primaries:
            v.sources[p].children.add(rid)
            v.ranking.place(v.sources[p])
        routes = self._routes_of(
            v,
            domain=receiver.domain,
            wants=wants,
            wants_key=wants_key,
            pieces=pieces,
            excluded=excluded,
        )
        assignment = Assignment(version, rid, routes)
        v.pulls[rid] = ReceiverPull(receiver.domain, primaries, assignment)
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

    def _routes_of(
        self,
        v: OpenVersion,
        *,
        domain: str,
        wants: Sequence[Want],
        wants_key: bytes,
        pieces: list[tuple[int, Box, str]],
        excluded: set[str],
    ) -> tuple[Route, ...]:
        """The routes of `pieces` (want index, box, primary), each with its fallbacks; those
        of a single-source assignment that repeats are the same object as before."""
        primaries = tuple(dict.fromkeys(p for _, _, p in pieces))
        order = Replay(v.ranking.ordered(domain, with_room=False))
        roots = sorted(
            (v.sources[r] for r in v.roots if r in v.sources),
            key=lambda s: (s.domain != domain, len(s.children), s.seq),
        )
        # A primary's own subtree stalls with it: no fallback comes from there.
        avoid = {p: excluded | descendants(v, p) for p in primaries}
        known: dict[str, bool | None] = {}

        def share(source_id: str) -> bool | None:
            if source_id not in known:
                known[source_id] = self._cuts.share(v.sources[source_id], wants, wants_key)
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
                    fallbacks(
                        v,
                        wants[i].name,
                        box,
                        primary=p,
                        excluded=avoid[p],
                        order=order,
                        roots=roots,
                        max_peers=self.config.max_peer_fallbacks,
                        whole=lambda s: share(s) is True,
                    )
                    if (uniform := same[p]) is None
                    else uniform,
                )
                for i, box, p in pieces
            )
        if memo_key is not None:
            self._routes[memo_key] = ([(i, b) for i, b, _ in pieces], routes)
            while len(self._routes) > _ROUTES_KEPT:
                self._routes.popitem(last=False)
        return routes

    def _uniform_fallbacks(
        self,
        v: OpenVersion,
        *,
        primary: str,
        excluded: set[str],
        order: Replay,
        roots: list[Source],
        share: Callable[[str], bool | None],
    ) -> tuple[str, ...] | None:
        """`tree_shape.uniform_fallbacks` with this tree's `max_peer_fallbacks`."""
        return uniform_fallbacks(
            v,
            primary=primary,
            excluded=excluded,
            order=order,
            roots=roots,
            max_peers=self.config.max_peer_fallbacks,
            share=share,
        )

    def release(self, version: int, receiver_id: str, outcome: PullOutcome) -> tuple[Orphan, ...]:
        """The receiver's pull ended: its child slots are free. A serving receiver's copy
        becomes complete, or, when the pull failed, stops being a source. Releasing again
        changes nothing."""
        self.expire()
        v = self._version(version)
        not_a_root(v, receiver_id)
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
        return listing(self._version(version))

    # -- internals ------------------------------------------------------------------------------

    def _version(self, version: int) -> OpenVersion:
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

    def _stage(self, source: Source) -> int:
        return 0 if source.state is CopyState.COMPLETE else source.stage

    def _choose(
        self,
        v: OpenVersion,
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
                cut, _ = self._cuts.cut(v.sources[source_id], wants, wants_key)
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

    def _end_pull(self, v: OpenVersion, receiver_id: str) -> None:
        pull = v.pulls.get(receiver_id)
        if pull is None or pull.active is None:
            return
        for parent in pull.active.parents:
            source = v.sources.get(parent)
            if source is not None:
                source.children.discard(receiver_id)
                v.ranking.place(source)
        pull.active = None

    def _remove(self, v: OpenVersion, source_id: str) -> tuple[Orphan, ...]:
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
