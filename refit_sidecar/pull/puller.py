"""A receiver's way to a version's bytes: one seam for reading the trainer's ranks directly
(`direct_puller.DirectPuller`) and through the sidecar's source tree
(`tree_puller.TreePuller`), so that asking ahead, early reads and the lease's end are one
sequence whatever the path.

A fetch goes lease → plan → pull → end:

1. `lease`: the lease asked ahead by `expect`, if it is still good, or one asked for now
   (`leasing.Leased`, kept alive until `end`);
2. `plan`: the receiver's plan of the leased version, from its `PlanBook` (the receiver knows
   what it wants of a manifest; the puller knows when a plan held for the lease's manifest key
   may be replayed, and what reading before the version is readable needs);
3. `pull`: staging filled with the plan's bytes, verified where the plan says;
4. `end`: how the lease held the version's slot for the whole pull (`leasing.LeaseLost` when
   it did not: nothing installs).

A fetch that fails after its lease calls `fail` instead of `end`: whatever the pull left in
flight is settled and the lease ends in the background.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from refit_sidecar.core.plan import PullPlan
from refit_sidecar.memory.region import Region
from refit_sidecar.pull.early_reads import EarlyPull
from refit_sidecar.pull.leasing import HeldBy, Leased
from refit_sidecar.pull.trace import Event
from refit_sidecar.pull.transport import PullStats
from refit_sidecar.service.client import Lease

Order = Sequence[tuple[str, int]]
"""A manifest's (parameter, number of shards) in its order: where each shard's checksums lie
in the version's flat list."""

Progress = Callable[[int, int], None]
"""`on_progress(filled, total)`: staging bytes filled in order so far."""


class HasPull(Protocol):
    """A receiver's plan of a version: at least what to pull into staging."""

    @property
    def pull(self) -> PullPlan: ...


P = TypeVar("P", bound=HasPull)


@dataclass(frozen=True)
class Planned(Generic[P]):
    """The plan of a leased version, and how it came."""

    plan: P
    replanned: bool
    """Planned anew from the trainer's manifest (False: an earlier plan was replayed)."""
    by_key: bool
    """Replayed on the lease's manifest key: no manifest was fetched or rebased."""
    early: EarlyPull | None = None
    """Leased before the version was readable: what its pull needs beyond the plan."""


class PlanBook(Protocol[P]):
    """The receiver's plans, by what it knows of a version (its manifest, or its lease's
    manifest key)."""

    def planned(self, lease: Lease) -> Planned[P]:
        """The plan of a readable version's lease (its manifest asked for if need be), with
        the checksums the pull checks."""
        ...

    def held(self, key: bytes) -> tuple[P, Order] | None:
        """The plan held for manifest key `key`, and that manifest's order; None when none
        is."""
        ...

    def layout(self, lease: Lease) -> tuple[P, Order] | None:
        """For a lease before its version is readable whose manifest key no held plan has:
        the plan of the layout the sidecar gives for the version (its slot's, as the trainer
        described it), held from then on under that key, and its order; None when the
        sidecar does not know it or gives another key."""
        ...

    def replayed(self, plan: P, pull: PullPlan) -> P:
        """`plan` pulling `pull` (the same targets, another version)."""
        ...


@dataclass(frozen=True)
class Pulled:
    """What a pull did: the transport's stats, and the tree's account of its sources."""

    stats: PullStats
    bytes_by_source: dict[str, int]
    started: float
    """Wall-clock time (time.time()) of the pull's start."""
    finished: float
    fallbacks: int = 0
    """Sources that failed mid-pull and were replaced (tree)."""
    ask_s: float = 0.0
    """Seconds asking the sidecar where to read (tree)."""
    reading_s: float = 0.0
    gated_s: float = 0.0
    prepared: int = 0
    asked_ahead: bool = False
    """The lease and the sources came in one call asked ahead (tree)."""
    routes_left_out: bool = False
    trace: tuple[Event, ...] = ()


class Puller(Protocol):
    """One receiver's lease → plan → pull → end (module docstring)."""

    def expect(self, version: int, *, wait_s: float) -> None:
        """Ask the sidecar now for `version`'s lease, answered the moment it can be (waiting
        up to `wait_s` there), so that the next `lease` of it need not ask."""
        ...

    def lease(self, version: int, *, wait_s: float) -> Leased:
        """The lease a fetch of `version` pulls under, kept alive until `end` or `fail`; a
        version not readable yet is waited for up to `wait_s`."""
        ...

    def plan(self, leased: Leased, book: PlanBook[P], *, wait_s: float) -> Planned[P]:
        """The leased version's plan from `book`; a version leased before it was readable is
        waited for (up to `wait_s`) as reading it early needs."""
        ...

    def pull(self, planned: Planned[Any], staging: Region, on_progress: Progress | None) -> Pulled:
        """Fill `staging` with the plan's bytes (the pull's errors are raised)."""
        ...

    def end(self, planned: Planned[Any], pulled: Pulled) -> HeldBy:
        """End the pull's lease: how it held (`leasing.LeaseLost` when it did not)."""
        ...

    def fail(self, leased: Leased, planned: Planned[Any] | None) -> None:
        """After a failed plan or pull: settle what it left in flight, end the lease."""
        ...

    def close(self) -> None: ...
