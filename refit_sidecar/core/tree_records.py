"""The source tree's public records: config, receivers, assignments, listings, errors.

Torch-free values exchanged with `refit_sidecar.service.tree.Tree` (which re-exports
them); the sidecar converts them to and from protos at its edge.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from refit_sidecar.core.manifest import Box
from trainer_refit.errors import InvalidRequest


class NodeKind(enum.Enum):
    TRAINER = "trainer"
    """A trainer rank's NIXL agent: a root, holding its shards' boxes."""
    PEER = "peer"
    """A receiver that serves the boxes it pulls."""
    RECEIVER = "receiver"
    """A receiver that only reads (tree listings only)."""


class CopyState(enum.Enum):
    FILLING = "filling"
    """Still being pulled; children read each chunk once it has arrived."""
    COMPLETE = "complete"
    """Every byte present and verified."""


class PullOutcome(enum.Enum):
    """How a receiver's pull ended (`Tree.release`)."""

    COMPLETE = "complete"
    """Verified: a serving receiver's copy becomes complete."""
    FAILED = "failed"
    """Given up: a serving receiver's partial copy stops being a source."""


class UnknownSource(LookupError):
    """The source is not registered for the version (never, unregistered, expired or dropped;
    maps to NOT_FOUND)."""


class NoSourceFree(RuntimeError):
    """Every source that holds some wanted bytes, outside the receiver's own subtree, already
    feeds its maximum of children: retry once a pull ends (maps to RESOURCE_EXHAUSTED)."""


class HeldForParent(NoSourceFree):
    """NoSourceFree because the tree holds slots for receivers of its previous shape
    (`TreeConfig.hold_parents_s`): an answer may come as soon as another receiver asks, and
    surely once the hold ends, at `until` (the tree's clock)."""

    def __init__(self, message: str, until: float) -> None:
        super().__init__(message)
        self.until = until


class NoLiveSource(RuntimeError):
    """No live source outside the receiver's own subtree holds some wanted bytes (the trainer
    ranks holding them were dropped; maps to UNAVAILABLE)."""


@dataclass(frozen=True, kw_only=True)
class TreeConfig:
    max_children: int = 2
    """Receivers one peer feeds at a time."""
    max_root_children: int = 2
    """Receivers one trainer rank feeds at a time: the first level of the tree."""
    peer_ttl_s: float = 30.0
    """How long a peer registration lives without a renewal."""
    max_peer_fallbacks: int = 2
    """Peers listed per piece after the primary's parents and before the trainer ranks."""
    hold_parents_s: float = 0.1
    """For this long after a version opens, each receiver's parents of its previous pull are
    held for it: a child slot it used is not given to another receiver, and a receiver whose
    previous parent has not asked for the version yet waits for it (NoSourceFree) instead of
    reading elsewhere. The tree then keeps its shape from version to version whatever order
    the receivers ask in, so every reader keeps the connection and the prepared requests it
    has with its parent (a first read from a new parent pays for both). 0: no holding."""

    def __post_init__(self) -> None:
        if self.max_children < 1 or self.max_root_children < 1:
            raise ValueError(
                f"max_children ({self.max_children}) and max_root_children "
                f"({self.max_root_children}) must be >= 1"
            )
        if not self.peer_ttl_s > 0:
            raise ValueError(f"peer_ttl_s must be > 0, got {self.peer_ttl_s}")
        if self.max_peer_fallbacks < 0:
            raise ValueError(f"max_peer_fallbacks must be >= 0, got {self.max_peer_fallbacks}")
        if self.hold_parents_s < 0:
            raise ValueError(f"hold_parents_s must be >= 0, got {self.hold_parents_s}")


@dataclass(frozen=True)
class Receiver:
    receiver_id: str
    """Unique among receivers; also its id as a peer source."""
    domain: str = ""
    """Topology domain (node, rack): peers of the same domain are preferred."""

    def __post_init__(self) -> None:
        if not self.receiver_id:
            raise InvalidRequest("a receiver needs an id", field="receiver_id")


@dataclass(frozen=True)
class Route:
    """Where one piece of a want is read: `primary`, else `fallbacks` in order (together they
    hold all of `box` while the trainer's ranks live)."""

    name: str
    box: Box
    primary: str
    fallbacks: tuple[str, ...]


@dataclass(frozen=True)
class Assignment:
    version: int
    receiver: str
    routes: tuple[Route, ...]
    """Ordered as the wants, each want's pieces tiling its box exactly once."""

    @property
    def parents(self) -> tuple[str, ...]:
        """The primaries, in first use: the sources whose child slots this pull holds."""
        return tuple(dict.fromkeys(r.primary for r in self.routes))


@dataclass(frozen=True)
class Orphan:
    """A pull that lost one of its sources (`parent`) while `child` was reading from it."""

    version: int
    parent: str
    child: str


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    kind: NodeKind
    domain: str
    state: CopyState
    depth: int
    """0 for a trainer rank; 1 + the deepest parent it read from (1 when not known)."""
    children: int
    """Receivers reading from it now."""
    expires_at: float | None
    """None for trainer ranks and receivers that only read."""


@dataclass(frozen=True)
class Edge:
    parent: str
    child: str
    active: bool
    """The child is reading from the parent now; else it did, in its last pull."""


@dataclass(frozen=True)
class TreeListing:
    """The tree of one version (ListTree, DEBUG logs): nodes by depth, then id."""

    version: int
    nodes: tuple[NodeInfo, ...]
    edges: tuple[Edge, ...]

    @property
    def depth(self) -> int:
        return max((n.depth for n in self.nodes), default=0)

    def describe(self) -> str:
        lines = [f"version {self.version}: {len(self.nodes)} nodes, depth {self.depth}"]
        parents: dict[str, list[str]] = {}
        for e in self.edges:
            parents.setdefault(e.child, []).append(e.parent + ("" if e.active else " (done)"))
        for n in self.nodes:
            lines.append(
                f"  {'  ' * n.depth}{n.node_id} [{n.kind.value}, {n.state.value}, "
                f"domain {n.domain!r}, {n.children} children] <- {parents.get(n.node_id, [])}"
            )
        return "\n".join(lines)
