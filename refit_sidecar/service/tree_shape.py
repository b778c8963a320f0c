"""The shape of one version's source tree (`tree.Tree`'s records of an open version): its
sources and receivers' pulls, the depths and subtrees they form, its listing, the fallbacks
of a route's piece, and the checks of what a call names in it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from refit_sidecar.core.manifest import Box
from refit_sidecar.core.plan import Want
from refit_sidecar.core.tree_records import (
    Assignment,
    CopyState,
    Edge,
    NodeInfo,
    NodeKind,
    TreeListing,
)
from refit_sidecar.service.source_order import Ranking, Replay, Source, holds_any
from trainer_refit.errors import InvalidRequest, quoted


@dataclass(eq=False)
class ReceiverPull:
    """A receiver's latest assignment: active until released."""

    domain: str
    fed_by: tuple[str, ...]
    active: Assignment | None
    state: CopyState = CopyState.FILLING


@dataclass(eq=False)
class OpenVersion:
    version: int
    shapes: dict[str, tuple[int, ...]]
    ranking: Ranking
    sources: dict[str, Source] = field(default_factory=dict)
    pulls: dict[str, ReceiverPull] = field(default_factory=dict)
    roots: list[str] = field(default_factory=list)
    """The trainer's ranks (agents), dropped ones included."""
    seq: Iterator[int] = field(default_factory=itertools.count)
    opened_at: float = 0.0
    gone: set[str] = field(default_factory=set)
    """Sources removed from this version (failed, lost, expired, unregistered)."""


def depths(v: OpenVersion) -> dict[str, int]:
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


def descendants(v: OpenVersion, root: str) -> set[str]:
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


def listing(v: OpenVersion) -> TreeListing:
    """The version's sources and receivers, with their depths, and who reads from whom."""
    depth = depths(v)
    nodes = []
    for node_id in set(v.sources) | set(v.pulls):
        source, pull = v.sources.get(node_id), v.pulls.get(node_id)
        if source is not None:
            info = NodeInfo(
                node_id,
                source.kind,
                source.domain,
                source.state,
                depth[node_id],
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
                depth[node_id],
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
        v.version,
        tuple(sorted(nodes, key=lambda n: (n.depth, n.node_id))),
        tuple(sorted(edges, key=lambda e: (e.child, e.parent))),
    )


def fallbacks(
    v: OpenVersion,
    name: str,
    box: Box,
    *,
    primary: str,
    excluded: set[str],
    order: Replay,
    roots: list[Source],
    max_peers: int,
    whole: Callable[[str], bool] = lambda s: False,
) -> tuple[str, ...]:
    """The fallbacks of the piece `box` of `name` read from `primary`: the primary's own
    parents, then up to `max_peers` other peers in `order`, then the trainer ranks (`roots`)
    holding any of it. `whole(source_id)`: the source holds every want (so any piece of
    them)."""

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
        if peers >= max_peers:
            break
        source = v.sources[source_id]
        if source.kind is NodeKind.PEER and source_id not in out and usable(source):
            out.append(source_id)
            peers += 1
    out += [r.source_id for r in roots if r.source_id not in out and usable(r)]
    return tuple(out)


def uniform_fallbacks(
    v: OpenVersion,
    *,
    primary: str,
    excluded: set[str],
    order: Replay,
    roots: list[Source],
    max_peers: int,
    share: Callable[[str], bool | None],
) -> tuple[str, ...] | None:
    """`fallbacks` of any piece of `primary`'s, when every source it would consider holds
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
        if peers >= max_peers:
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


def check_wants(v: OpenVersion, wants: Sequence[Want], field_name: str) -> None:
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


def not_a_root(v: OpenVersion, node_id: str) -> None:
    if node_id in v.roots:
        raise InvalidRequest(
            f"{quoted(node_id)} is a trainer rank of version {v.version}, not a receiver"
        )


def check_same(v: OpenVersion, source: Source, held: dict[str, tuple[Box, ...]]) -> None:
    if source.holds != held:
        raise InvalidRequest(
            f"peer {quoted(source.source_id)} holds other boxes of version {v.version}; "
            "unregister it before it serves another layout"
        )
