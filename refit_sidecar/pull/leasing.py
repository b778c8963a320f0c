"""A receiver's leases: asked for ahead, held while its pull reads, ended after it.

A lease pins the trainer's snapshot slot of a version: while it holds, the trainer publishes no
other version into that slot. A receiver that dies mid-pull keeps its lease until the lease's
time runs out, so the time a lease is granted for is how long a dead receiver can hold up the
trainer's publication. `LeaseKeeper` renews the lease of the pull in progress every third of
that time: a live receiver keeps its version for as long as its pull takes, a dead one frees the
slot within one lease time.

Asked ahead (`Receiver.expect`): a call left in flight before the version is readable, which the
sidecar answers the moment the trainer's ranks have published it, so the refit that follows
starts reading at once (`AskedAhead`): an AcquireLease on the direct path (`AheadLease`; with
`before_readable` the lease may come earlier, at the slot's reservation, without checksums,
their GetChecksums left in flight beside it), a GetSources that carries a lease through the
source tree (`TreePull.ask_ahead`). A lease asked long before its pull (a follower asks for the
next version before a step that takes longer than half a TTL) is renewed at once, beside the
pull's first reads rather than before them, and the pull's end waits for that renewal's answer,
so it still knows whether the lease held throughout.

Ended (`Leasing.end`): the lease must have held the slot for the whole pull (`HeldBy` says how
the refit knows); one that did not fails the refit (`LeaseLost`).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from refit_sidecar.core.plan import PullPlan
from refit_sidecar.service.client import Lease, SidecarClient, VersionChecksums
from refit_sidecar.service.pending import Pending

log = logging.getLogger(__name__)

T = TypeVar("T")

RELEASE_AFTER_S = 0.005
"""A pull whose bytes need no word from the sidecar (all verified, or the version words still
name the version) ends its lease this long after the fetch, when the refit's install is
through: a receiver's threads share one interpreter, and a release sent at the fetch's end
takes it from the install. The slot it frees is wanted by the trainer's next step, much later."""


class HeldBy(enum.StrEnum):
    """How a refit knew that no byte it pulled was overwritten (its lease held the slot)."""

    CHECKSUMS = "checksums"
    """Every byte was verified against the trainer's checksums."""
    WORDS = "words"
    """The trainer ranks' version words still named the version after the pull (a rank
    zeroes them before it overwrites the slot)."""
    SIDECAR = "sidecar"
    """The sidecar confirmed the lease when it was released (one round trip on the path)."""


class LeaseLost(RuntimeError):
    """The lease ended before its pull did: the bytes may have been overwritten."""


def renewed(client: SidecarClient, lease: Lease, ttl_s: float) -> Lease:
    """`lease` renewed for `ttl_s` from now: its `expires_at` counts from this call's start
    (the sidecar's errors are raised: UnknownLease when it ended)."""
    sent = time.monotonic()
    renewal = client.renew_lease(lease, ttl_s)
    return replace(lease, expires_at=sent + renewal.expires_in_seconds)


class LeaseKeeper:
    """Renews the lease handed to `keep` every `ttl_s / 3` seconds until `take_back`. One
    thread per receiver, idle between pulls: a refit only hands it the lease and takes it
    back."""

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


@dataclass
class AskedAhead(Generic[T]):
    """A call left in flight whose answer brings a lease on `version`: an AcquireLease
    (`AheadLease`) or a GetSources with a lease (`TreePull.ask_ahead`, `key` naming the wants
    and offer it was built from)."""

    version: int
    answer: Pending[T]
    lease_of: Callable[[T], Lease]
    """The lease in an answer (its `expires_at` counting from when the call was sent)."""
    key: object = None
    taken: bool = False
    """The caller took the lease (`lease`): it holds and ends it."""

    def lease(self) -> Lease | None:
        """The answer's lease (waiting for it); None when the call did not give one (refused,
        cancelled, the sidecar restarted meanwhile, ...)."""
        try:
            return self.lease_of(self.answer.result())
        except Exception as e:
            log.debug("version %d: the lease asked ahead was not given: %s", self.version, e)
            return None


def _as_is(lease: Lease) -> Lease:
    return lease


class AheadLease:
    """The direct path's lease asked ahead: at most one, for one version. `releases` runs the
    release of a lease that was answered but not used, off the caller's path."""

    def __init__(self, client: SidecarClient, releases: Executor) -> None:
        self._client = client
        self._releases = releases
        self._asked: AskedAhead[Lease] | None = None
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
        self._asked = AskedAhead(version, pending, _as_is)

    def asked(self, version: int) -> bool:
        return self._asked is not None and self._asked.version == version

    def take_checksums(self) -> Pending[VersionChecksums] | None:
        """The GetChecksums asked with the lease last taken, if any (the caller owns it now:
        cancel it when unused)."""
        sums, self._sums = self._sums, None
        return sums

    def take(self, version: int) -> Lease | None:
        """The lease asked ahead on `version` (waiting for the answer); None when none was
        asked, or the call did not give one: the caller then leases it itself, and that call
        says what is wrong, if anything still is. Another version's is dropped."""
        if not self.asked(version):
            self.drop()
            return None
        asked, self._asked = self._asked, None
        assert asked is not None
        return asked.lease()

    def drop(self) -> None:
        """Cancel the lease asked ahead, or release it when it was granted already."""
        if self._sums is not None:
            self._sums.cancel()
            self._sums = None
        asked, self._asked = self._asked, None
        if asked is None:
            return
        pending = asked.answer
        if pending.cancel() or pending.exception() is not None:
            return
        self._releases.submit(self._client.end_lease, pending.result())
        log.debug("version %d: the lease asked ahead was not used; released", asked.version)


@dataclass(frozen=True, kw_only=True)
class LeaseTerms:
    """What a receiver's leases are asked with."""

    receiver_id: str
    """Names the receiver in its leases."""
    ttl_s: float
    """A lease's time, renewed every third of it while its pull runs (`LeaseKeeper`)."""
    checksums: bool
    """Leases carry the version's checksums (the receiver verifies what it pulls)."""


@dataclass(frozen=True)
class Leased:
    """A lease in hand for a fetch, kept alive (`Leasing.hold`) until `Leasing.end`."""

    lease: Lease
    expected: bool
    """It had been asked for ahead (`Receiver.expect`) and was still good."""
    at: float
    """Wall-clock time (time.time()) it was in hand."""
    mark: float
    """time.perf_counter() then."""
    sidecar_readable_at: float = 0.0
    """From the answer that brought it, by the sidecar's clock (0 for a renewal of a lease
    asked long before: its answer has none)."""
    sidecar_answered_at: float = 0.0
    checksums: Pending[VersionChecksums] | None = None
    """A lease granted before its version was readable (`Lease.pending`): the version's
    GetChecksums in flight, if asked beside it (the pull's to use or cancel)."""


class Leasing:
    """One receiver's leases: the direct path's asked ahead (`ahead`), the one its pull holds
    (kept alive), and their ends, off the refit's path where nothing needs the answer."""

    def __init__(self, client: SidecarClient, terms: LeaseTerms) -> None:
        self._client = client
        self.terms = terms
        self._releases = ThreadPoolExecutor(1, thread_name_prefix="lease-release")
        """Releases of verified pulls' leases, off the refit's path."""
        self._keeper = LeaseKeeper(client, terms.ttl_s)
        """Renews the lease of the pull in progress."""
        self.ahead = AheadLease(client, self._releases)
        """Direct path: the lease asked ahead by `Receiver.expect`."""

    def ask_ahead(self, version: int, *, wait_s: float, before_readable: bool) -> None:
        """Direct path: ask now for `version`'s lease (`AheadLease.ask`)."""
        terms = self.terms
        self.ahead.ask(
            version,
            terms.receiver_id,
            terms.ttl_s,
            wait_s=wait_s,
            checksums=terms.checksums,
            before_readable=before_readable,
        )

    def hold(
        self,
        version: int,
        asked: Lease | None,
        *,
        wait_s: float,
        expected: bool = True,
        checksums: Pending[VersionChecksums] | None = None,
    ) -> Leased:
        """The lease a fetch of `version` pulls under, kept alive from now: `asked` (the one
        asked ahead, if still good; `expected` says whether it counts as asked by `expect`),
        else one leased now, waiting up to `wait_s` for the version to be readable.
        `checksums`: the GetChecksums asked beside `asked`, kept for a lease granted before
        its version was readable, cancelled otherwise."""
        answer, renew_now = asked, False
        try:
            lease = asked
            if lease is not None:
                lease, renew_now = self._fresh(lease)
            expected = lease is not None and expected
            if lease is None:
                lease = answer = self._acquire(version, wait_s)
        except Exception:
            if checksums is not None:
                checksums.cancel()
            raise
        if checksums is not None and not lease.pending:
            checksums.cancel()  # the lease came with its checksums
            checksums = None
        mark, at = time.perf_counter(), time.time()
        # The sidecar's times, from its answer (a renewal of a lease asked long before has none).
        sidecar = (answer.readable_at, answer.answered_at) if answer is not None else (0.0, 0.0)
        self._keeper.keep(lease, renew_now=renew_now)
        return Leased(lease, expected, at, mark, *sidecar, checksums)

    def _fresh(self, lease: Lease) -> tuple[Lease | None, bool]:
        """A lease asked ahead counts its end from when it was asked. One with under half a
        TTL left is renewed: beside the pull when it surely still holds by this process's
        clock (True: the keeper renews it at once, and the pull's end learns whether that
        held), before it otherwise. None when it cannot be (it ran out before the fetch
        came): the caller leases anew."""
        ttl = self.terms.ttl_s
        left = lease.expires_at - time.monotonic()
        if left >= ttl / 2:
            return lease, False
        if left > 0:
            return lease, True
        try:
            return renewed(self._client, lease, ttl), False
        except Exception as e:
            log.debug("the lease asked ahead on version %d ended: %s", lease.version, e)
            return None, False

    def _acquire(self, version: int, wait_s: float) -> Lease:
        """A lease on `version`, with its checksums when they will be checked; one not readable
        yet is waited for on the sidecar (`wait_s`), so the lease comes back as soon as the
        trainer's ranks have reported it."""
        terms = self.terms
        return self._client.acquire_lease(
            version,
            terms.receiver_id,
            terms.ttl_s,
            wait_s=max(wait_s, 0.0),
            checksums=terms.checksums,
        )

    def end(
        self, pull: PullPlan, verified: int, unchanged: Callable[[PullPlan], bool] | None = None
    ) -> HeldBy:
        """After the pull of `pull` (`verified` of its reads checked): how the lease held the
        slot for the whole pull; LeaseLost when it did not. Past the lease's end by this
        process's clock it surely did not. Before it, bytes that were all verified need no
        more, nor do bytes of ranks whose version words still name the version after the pull
        (`unchanged`; a rank zeroes them before it overwrites the slot): the release goes out
        in the background. Otherwise the sidecar must confirm it held the lease."""
        lease, lost = self._keeper.take_back()
        in_time = not lost and time.monotonic() < lease.expires_at  # else nothing proves it
        held_by = HeldBy.SIDECAR
        if in_time and verified == len(pull.reads):
            held_by = HeldBy.CHECKSUMS
        elif in_time and unchanged is not None and unchanged(pull):
            held_by = HeldBy.WORDS
        if lost:
            held = False  # a renewal found the lease gone: the slot may have been rewritten
        elif held_by is not HeldBy.SIDECAR:
            self._releases.submit(self._release_later, lease)
            held = True
        else:
            held = self._client.end_lease(lease) and time.monotonic() < lease.expires_at
        if not held:
            # A lease the sidecar no longer knows (expired, or the sidecar restarted) did not
            # protect the slot for the whole pull: the trainer may have overwritten it.
            raise LeaseLost(
                f"the lease on version {lease.version} ended before its pull did (expired, or "
                "the sidecar restarted); the bytes may have been overwritten, so nothing installs"
            )
        return held_by

    def drop(self, lease: Lease) -> None:
        """After a failed fetch: stop renewing `lease` and end it in the background."""
        self._keeper.take_back(wait=False)
        self._releases.submit(self._client.end_lease, lease)

    def _release_later(self, lease: Lease) -> None:
        """Ends a verified pull's lease `RELEASE_AFTER_S` from now (on the releases' thread)."""
        time.sleep(RELEASE_AFTER_S)
        self._client.end_lease(lease)

    def close(self) -> None:
        self.ahead.drop()
        self._keeper.close()
        self._releases.shutdown(wait=True)
