"""Keeps a receiver's lease alive while it pulls, so the lease can be short.

A lease pins the trainer's snapshot slot of a version: while it holds, the trainer publishes no
other version into that slot. A receiver that dies mid-pull keeps its lease until the lease's
time runs out, so the time a lease is granted for is how long a dead receiver can hold up the
trainer's publication. The keeper renews the lease of the pull in progress every third of that
time: a live receiver keeps its version for as long as its pull takes, a dead one frees the slot
within one lease time. One thread per receiver, idle between pulls: a refit only hands it the
lease and takes it back.

A lease asked for long before its pull (a follower asks for the next version before a step
that takes longer than half a TTL) is handed over with `renew_now`: renewed at once, beside
the pull's first reads rather than before them, and `take_back` waits for that renewal's
answer, so the pull's end still knows whether the lease held throughout.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

from refit_sidecar.service.client import Lease, SidecarClient

log = logging.getLogger(__name__)


def renewed(client: SidecarClient, lease: Lease, ttl_s: float) -> Lease:
    """`lease` renewed for `ttl_s` from now: its `expires_at` counts from this call's start
    (the sidecar's errors are raised: UnknownLease when it ended)."""
    sent = time.monotonic()
    renewal = client.renew_lease(lease, ttl_s)
    return replace(lease, expires_at=sent + renewal.expires_in_seconds)


class LeaseKeeper:
    """Renews the lease handed to `keep` every `ttl_s / 3` seconds until `take_back`."""

    def __init__(self, client: SidecarClient, ttl_s: float) -> None:
        self._client = client
        self._ttl_s = ttl_s
        self._cond = threading.Condition()
        self._lease: Lease | None = None
        self._lost = False
        self._due = 0.0
        self._owed = False
        """A renewal asked for at `keep` has not been answered yet."""
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._thread.start()

    def keep(self, lease: Lease, *, renew_now: bool = False) -> None:
        """Renew `lease` from now on (it replaces any lease kept before); with `renew_now`,
        the first renewal goes out at once and `take_back` waits for its answer."""
        with self._cond:
            self._lease, self._lost, self._owed = lease, False, renew_now
            self._due = time.monotonic() + (0.0 if renew_now else self._ttl_s / 3)
            self._cond.notify_all()

    def take_back(self, *, wait: bool = True) -> tuple[Lease, bool]:
        """Stop renewing; the lease as last renewed, and whether a renewal found it gone (the
        sidecar may no longer hold it). A renewal that failed leaves `expires_at` where the
        last good one put it, so a pull past it fails closed. A renewal asked for with
        `renew_now` is waited for (unless not `wait`: a failed pull needs no answer); any
        other renewal in flight is not."""
        with self._cond:
            while wait and self._owed and not self._closed:
                self._cond.wait()
            self._owed = False
            lease, lost = self._lease, self._lost
            self._lease = None
        if lease is None:
            raise RuntimeError("no lease is kept")
        return lease, lost

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                lease = self._lease
                wait = self._due - time.monotonic()
                if lease is None or self._lost or wait > 0:
                    self._cond.wait(None if lease is None or self._lost else wait)
                    continue
                self._cond.release()  # the RPC runs unlocked: taking the lease back never waits
                try:
                    fresh, error = renewed(self._client, lease, self._ttl_s), None
                except Exception as e:  # ended (expired, the sidecar restarted) or unreachable
                    fresh, error = None, e
                finally:
                    self._cond.acquire()
                if self._lease is not lease:
                    continue  # taken back (or replaced) meanwhile: the answer is moot
                self._owed = False
                self._cond.notify_all()
                if fresh is None:
                    log.warning("renewing lease %s failed: %s", lease.lease_id, error)
                    self._lost = True
                    continue
                self._lease = fresh
                self._due = time.monotonic() + self._ttl_s / 3
