"""Keeps a receiver's lease alive while it pulls, so the lease can be short.

A lease pins the trainer's snapshot slot of a version: while it holds, the trainer publishes no
other version into that slot. A receiver that dies mid-pull keeps its lease until the lease's
time runs out, so the time a lease is granted for is how long a dead receiver can hold up the
trainer's publication. The keeper renews the lease every third of that time while the pull
runs: a live receiver keeps its version for as long as its pull takes, a dead one frees the
slot within one lease time.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

from refit_sidecar.client import Lease, SidecarClient

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Renews `lease` every `ttl_s / 3` seconds on its own thread until `stop`."""

    def __init__(self, client: SidecarClient, lease: Lease, ttl_s: float) -> None:
        self._client = client
        self._ttl_s = ttl_s
        self._lease = lease
        self._lost = False
        self.renewals = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"lease-{lease.lease_id[:8]}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._ttl_s / 3):
            sent = time.monotonic()
            try:
                renewed = self._client.renew_lease(self._lease, self._ttl_s)
            except Exception as e:  # ended (expired, the sidecar restarted) or unreachable
                log.warning("renewing lease %s failed: %s", self._lease.lease_id, e)
                self._lost = True
                return
            self._lease = replace(self._lease, expires_at=sent + renewed.expires_in_seconds)
            self.renewals += 1

    def stop(self) -> Lease:
        """Stops renewing; returns the lease as last renewed. A renewal that failed leaves its
        `expires_at` at the end the last good one gave it, so a pull past it fails closed."""
        self._stop.set()
        self._thread.join()
        return self._lease

    @property
    def lost(self) -> bool:
        """A renewal failed: the sidecar may no longer hold the lease."""
        return self._lost
