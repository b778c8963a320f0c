"""A receiver that reads through the sidecar's source tree (`puller.Puller`, docs/fanout.md).

Its lease comes with its sources, in one GetSources asked ahead (`TreePull.ask_ahead`: by
`expect`, or by the fetch itself after a first pull, whose wants and offer it repeats). Its
pull is `TreePull.pull`: chunks gated on each parent's progress, sources replaced when they
fail, every byte checked against the trainer's checksums before the copy is complete.
"""

from __future__ import annotations

import time
from typing import Any

from refit_sidecar.core.plan import PullPlan
from refit_sidecar.memory.region import Region
from refit_sidecar.pull.leasing import HeldBy, Leased, Leasing
from refit_sidecar.pull.puller import P, PlanBook, Planned, Progress, Pulled
from refit_sidecar.pull.transport import PullStats
from refit_sidecar.pull.tree_pull import TreePull
from refit_sidecar.service.client import UnknownVersion


class TreePuller:
    """`tree`'s pulls under `leasing`'s leases; a pull not done `pull_timeout_s` after it
    started fails."""

    def __init__(self, leasing: Leasing, tree: TreePull, *, pull_timeout_s: float) -> None:
        self._leasing = leasing
        self._tree = tree
        self._pull_timeout_s = pull_timeout_s

    def expect(self, version: int, *, wait_s: float) -> None:
        """Needs a first pull (until then this does nothing)."""
        terms = self._leasing.terms
        self._tree.ask_ahead(
            version, wait_s=wait_s, lease_ttl_s=terms.ttl_s, checksums=terms.checksums
        )

    def lease(self, version: int, *, wait_s: float) -> Leased:
        """One call for the lease and the tree's answer: they come back together. `expect`
        may have sent it already."""
        tree, terms = self._tree, self._leasing.terms
        try:
            asked = tree.asked(version)
            if not asked:
                tree.ask_ahead(
                    version,
                    wait_s=max(wait_s, 0.0),
                    lease_ttl_s=terms.ttl_s,
                    checksums=terms.checksums,
                )
            ahead, refused = tree.ahead_lease()
            if isinstance(refused, UnknownVersion) and not asked:
                wait_s = 0.0  # waited for already: lease it now if it came meanwhile
            return self._leasing.hold(version, ahead, wait_s=wait_s, expected=asked)
        except Exception:
            tree.abandon()
            raise

    def plan(self, leased: Leased, book: PlanBook[P], *, wait_s: float) -> Planned[P]:
        return book.planned(leased.lease)

    def pull(self, planned: Planned[Any], staging: Region, on_progress: Progress | None) -> Pulled:
        deadline = time.monotonic() + self._pull_timeout_s
        plan: PullPlan = planned.plan.pull
        tree = self._tree.pull(plan, staging, deadline=deadline, on_progress=on_progress)
        stats = PullStats(
            tree.nbytes,
            tree.seconds,
            tree.reads,
            tree.chunks,
            0,
            tree.verified_shards,
            partial_sums=tree.partial_sums,
        )
        return Pulled(
            stats,
            tree.bytes_by_source,
            tree.started,
            tree.finished,
            tree.fallbacks,
            tree.ask_s,
            tree.reading_s,
            tree.gated_s,
            tree.prepared,
            tree.asked_ahead,
            tree.routes_left_out,
            tree.trace,
        )

    def end(self, planned: Planned[Any], pulled: Pulled) -> HeldBy:
        plan: PullPlan = planned.plan.pull
        return self._leasing.end(plan, pulled.stats.verified_shards)

    def fail(self, leased: Leased, planned: Planned[Any] | None) -> None:
        self._tree.abandon()  # when the pull did not take the answer asked ahead
        self._leasing.drop(leased.lease)

    def close(self) -> None:
        self._leasing.close()
        self._tree.close()
