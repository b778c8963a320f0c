"""A receiver's lease asked for ahead (`Receiver.expect`) on the direct path: an AcquireLease
left in flight before the version is readable, which the sidecar answers the moment the
trainer's ranks have published it, so the refit that follows starts reading at once. (Through
the source tree the same is one GetSources, `TreePull.ask_ahead`.) With `before_readable` the
lease may come earlier, at the slot's reservation, without checksums: their GetChecksums is
left in flight beside it, answered once the version is readable."""

from __future__ import annotations

import logging
from concurrent.futures import Executor

from refit_sidecar.service.client import Lease, SidecarClient, VersionChecksums
from refit_sidecar.service.pending import Pending

log = logging.getLogger(__name__)


class AheadLease:
    """At most one lease asked ahead, for one version. `releases` runs the release of a lease
    that was answered but not used, off the caller's path."""

    def __init__(self, client: SidecarClient, releases: Executor) -> None:
        self._client = client
        self._releases = releases
        self._pending: tuple[int, Pending[Lease]] | None = None
        self._sums: Pending[VersionChecksums] | None = None
        """The GetChecksums asked beside a lease that may come before the version is
        readable."""

    def ask(
        self,
        version: int,
        receiver_id: str,
        ttl_s: float,
        *,
        wait_s: float,
        checksums: bool,
        before_readable: bool = False,
    ) -> None:
        """Ask for a lease on `version` now (any other asked ahead is dropped);
        `before_readable`: granted once its slot is reserved, where the sidecar can (with
        `checksums`, the version's GetChecksums is asked too)."""
        self.drop()
        if before_readable and checksums:
            self._sums = self._client.checksums_later(version, wait_s=wait_s)
        pending = self._client.lease_later(
            version,
            receiver_id,
            ttl_s,
            wait_s=wait_s,
            checksums=checksums,
            before_readable=before_readable,
        )
        self._pending = (version, pending)

    def asked(self, version: int) -> bool:
        return self._pending is not None and self._pending[0] == version

    def take_checksums(self) -> Pending[VersionChecksums] | None:
        """The GetChecksums asked with the lease last taken, if any (the caller owns it now:
        cancel it when unused)."""
        sums, self._sums = self._sums, None
        return sums

    def take(self, version: int) -> Lease | None:
        """The lease asked ahead on `version` (waiting for the answer); None when none was
        asked, or the call did not give one (the version was not readable within its wait,
        the sidecar restarted meanwhile, ...): the caller then leases it itself, and that call
        says what is wrong, if anything still is. Another version's is dropped."""
        if not self.asked(version):
            self.drop()
            return None
        assert self._pending is not None
        pending, self._pending = self._pending[1], None
        try:
            return pending.result()
        except Exception as e:
            log.debug("version %d: the lease asked ahead was not given: %s", version, e)
            return None

    def drop(self) -> None:
        """Cancel the lease asked ahead, or release it when it was granted already."""
        if self._sums is not None:
            self._sums.cancel()
            self._sums = None
        if self._pending is None:
            return
        version, pending = self._pending
        self._pending = None
        if pending.cancel() or pending.exception() is not None:
            return
        self._releases.submit(self._client.end_lease, pending.result())
        log.debug("version %d: the lease asked ahead was not used; released", version)
