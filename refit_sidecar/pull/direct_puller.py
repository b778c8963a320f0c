"""A receiver that reads the trainer's ranks itself (`puller.Puller`, docs/refit.md).

Its lease asked ahead is an AcquireLease (`leasing.AheadLease`), granted before the version is
readable where the sidecar can (`before_readable`): the fetch then replays the plan held for
the lease's manifest key and reads on the ranks' version words or behind their snapshot copy
(`early_reads.BeforeReadable`). Its pull is one `NixlTransport.pull` of the plan, verified
where staging is. Its lease needs no word from the sidecar at the end when every byte was
verified, or when the ranks' version words still name the version after the pull.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import grpc

from refit_sidecar.core.plan import PullPlan
from refit_sidecar.memory.region import Region
from refit_sidecar.pull.early_reads import BeforeReadable
from refit_sidecar.pull.leasing import HeldBy, Leased, Leasing
from refit_sidecar.pull.nixl_transport import NixlTransport
from refit_sidecar.pull.progress import HostWords, Words
from refit_sidecar.pull.puller import P, PlanBook, Planned, Progress, Pulled
from refit_sidecar.pull.trace import PullTrace
from refit_sidecar.service.client import SidecarClient

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class DirectConfig:
    before_readable: bool = True
    """`expect` asks for a lease granted once the version's slot is reserved, before the
    version is readable (`RefitOptions.direct.read_before_readable`)."""
    behind_copy: bool = True
    """Read such a version behind the ranks' snapshot copy, request by request, where they
    copy in pieces (`piece_gate.PieceGate`)."""
    verify: bool = True
    """Check the trainer's checksums of every shard read whole."""
    trace: bool = False
    """Record each pull's timeline (`trace.PullTrace`)."""


class DirectPuller:
    def __init__(
        self,
        client: SidecarClient,
        transport: NixlTransport,
        leasing: Leasing,
        config: DirectConfig,
        *,
        words: Callable[[int], Words] = HostWords,
    ) -> None:
        """`words` makes the memory the sources' version words are read into: where staging
        is (device memory for a GPU's)."""
        self._client = client
        self._transport = transport
        self._leasing = leasing
        self.config = config
        self._before = BeforeReadable(client, transport, words)
        """Pulls of versions leased before they were readable."""
        self._by_source: tuple[Any, dict[str, int]] = ((), {})
        """The bytes each source gives the last plan's reads met (a replayed plan's reads are
        the same objects: counted once, not after every pull)."""

    def expect(self, version: int, *, wait_s: float) -> None:
        self._leasing.ask_ahead(version, wait_s=wait_s, before_readable=self.config.before_readable)

    def lease(self, version: int, *, wait_s: float) -> Leased:
        ahead = self._leasing.ahead.take(version)
        sums = self._leasing.ahead.take_checksums()
        # The checksums asked beside a lease granted before the version was readable lost
        # their sidecar: it went away (a restart forgets leases and reservations, and the
        # trainer may publish the version into another slot). Lease anew.
        error = sums.exception() if sums is not None and sums.done() else None
        died = isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNAVAILABLE
        if ahead is not None and ahead.pending and died:
            log.info("version %d: the lease asked ahead died with its sidecar", version)
            ahead = sums = None
        return self._leasing.hold(version, ahead, wait_s=wait_s, checksums=sums)

    def plan(self, leased: Leased, book: PlanBook[P], *, wait_s: float) -> Planned[P]:
        """A readable version's plan comes from the book. One leased before it was readable
        replays the plan held for the lease's manifest key, once the sources' version words
        name the version (or at once behind a copy in pieces); a key this receiver has not met
        (its first version from that slot) is planned from the manifest once the version is
        readable."""
        lease = leased.lease
        if not lease.pending:
            return book.planned(lease)
        wait = max(wait_s, 0.0)
        deadline = time.monotonic() + wait
        held = book.held(lease.manifest_key) or book.layout(lease)
        asked = leased.checksums
        if held is None:
            if asked is None:
                asked = self._client.checksums_later(lease.version, wait_s=wait)
            asked.result()  # answered once the version is readable
            return book.planned(replace(lease, pending=False))
        plan, order = held
        early = self._before.start(
            lease,
            plan.pull,
            order,
            verify=self.config.verify,
            deadline=deadline,
            asked=asked,
            behind_copy=self.config.behind_copy,
        )
        return Planned(book.replayed(plan, early.plan), replanned=False, by_key=True, early=early)

    def pull(self, planned: Planned[Any], staging: Region, on_progress: Progress | None) -> Pulled:
        plan: PullPlan = planned.plan.pull
        early = planned.early
        started = time.time()
        stats = self._transport.pull(
            plan,
            staging,
            verify=self.config.verify,
            checksums_later=None if early is None else early.checksums,
            gate=None if early is None else early.gate,
            trace=PullTrace() if self.config.trace else None,
        )
        counted, by_source = self._by_source
        if counted is not plan.reads:
            by_source = {}
            for reads in plan.reads:
                agent = reads.location.agent
                by_source[agent] = by_source.get(agent, 0) + reads.nbytes
            self._by_source = (plan.reads, by_source)
        if on_progress is not None:
            on_progress(plan.nbytes, plan.nbytes)
        return Pulled(
            stats,
            dict(by_source),
            started,
            time.time(),
            gated_s=stats.gated_s,
            trace=stats.trace,
        )

    def end(self, planned: Planned[Any], pulled: Pulled) -> HeldBy:
        plan: PullPlan = planned.plan.pull
        return self._leasing.end(plan, pulled.stats.verified_shards, self._before.unchanged)

    def fail(self, leased: Leased, planned: Planned[Any] | None) -> None:
        early = None if planned is None else planned.early
        if early is not None and early.asked is not None:
            early.asked.cancel()
        if early is not None and early.gate is not None:
            early.gate.settle()  # its look may be in flight if the pull never started
        self._leasing.drop(leased.lease)

    def close(self) -> None:
        self._leasing.close()
        self._before.release()
