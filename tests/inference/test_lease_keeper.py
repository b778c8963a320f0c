"""`leasing.LeaseKeeper` on its own: renewals every third of the TTL while a lease is
kept, none after it is taken back, a failed renewal reported as lost with the last good end,
and taking back never waiting for a renewal in flight. The sidecar is a stand-in that answers
renewals as the real one does (the real sidecar's renewals are tested end to end in
tests/refit/test_sidecar_service.py and the receivers' tests)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

import pytest

from refit_sidecar.pull.leasing import LeaseKeeper, renewed
from refit_sidecar.service.client import Lease, UnknownLease

TTL = 0.3


class _Sidecar:
    """Answers `renew_lease` with a fresh TTL, or raises `error`; `gate` holds answers back."""

    def __init__(self) -> None:
        self.renewals: list[tuple[str, float]] = []
        self.error: Exception | None = None
        self.gate = threading.Event()
        self.gate.set()
        self.asked = threading.Event()

    def renew_lease(self, lease: Lease, ttl: float) -> Lease:
        self.asked.set()
        self.gate.wait()
        self.renewals.append((lease.lease_id, ttl))
        if self.error is not None:
            raise self.error
        return replace(lease, expires_in_seconds=ttl)


def _until(done: Any, timeout: float = 10.0) -> None:
    """Polls `done()` until true (a loaded machine runs the keeper's thread late)."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _keeper(sidecar: _Sidecar) -> LeaseKeeper:
    client: Any = sidecar
    return LeaseKeeper(client, TTL)


def test_a_kept_lease_is_renewed_every_third_of_its_ttl_until_taken_back() -> None:
    sidecar = _Sidecar()
    keeper = _keeper(sidecar)
    try:
        start = time.monotonic()
        lease = Lease("a", 3, TTL, receiver_id="r", expires_at=start + TTL)
        keeper.keep(lease)
        _until(lambda: len(sidecar.renewals) >= 2)
        assert time.monotonic() - start >= 2 * TTL / 3  # a third of the TTL apart
        time.sleep(0.05)  # the second renewal's answer is recorded
        kept, lost = keeper.take_back()
        assert not lost
        assert sidecar.renewals[:2] == [("a", TTL)] * 2
        assert kept.expires_at > lease.expires_at  # counted from the last renewal's start
        assert kept.expires_at <= time.monotonic() + TTL
        count = len(sidecar.renewals)
        time.sleep(TTL)
        assert len(sidecar.renewals) == count  # none once taken back
        with pytest.raises(RuntimeError, match="no lease is kept"):
            keeper.take_back()
    finally:
        keeper.close()


def test_a_renewal_that_fails_is_reported_and_keeps_the_last_good_end() -> None:
    sidecar = _Sidecar()
    sidecar.error = UnknownLease("lease a ended")
    keeper = _keeper(sidecar)
    try:
        lease = Lease("a", 3, TTL, receiver_id="r", expires_at=time.monotonic() + TTL)
        keeper.keep(lease)
        _until(lambda: len(sidecar.renewals) >= 1)
        time.sleep(TTL)  # the failure is recorded; a lost lease is not asked for again
        kept, lost = keeper.take_back()
        assert lost and kept.expires_at == lease.expires_at
        assert len(sidecar.renewals) == 1

        sidecar.error = None  # the next pull's lease starts afresh
        keeper.keep(replace(lease, lease_id="b"))
        time.sleep(TTL / 2)
        kept, lost = keeper.take_back()
        assert not lost and kept.lease_id == "b"
    finally:
        keeper.close()


def test_taking_back_never_waits_for_a_renewal_in_flight() -> None:
    sidecar = _Sidecar()
    sidecar.gate.clear()
    keeper = _keeper(sidecar)
    try:
        lease = Lease("a", 3, TTL, receiver_id="r", expires_at=time.monotonic() + TTL)
        keeper.keep(lease)
        assert sidecar.asked.wait(TTL)
        started = time.monotonic()
        kept, lost = keeper.take_back()
        assert time.monotonic() - started < TTL / 10
        assert kept is lease and not lost  # the renewal's answer is moot
        sidecar.gate.set()
    finally:
        keeper.close()


def test_a_lease_renewed_now_is_renewed_at_once_and_its_answer_waited_for() -> None:
    """`keep(..., renew_now=True)`: a lease asked long before its pull is renewed beside the
    pull's first reads; `take_back` waits for that answer (the pull's end must know whether
    the lease held), unless told not to (a failed pull)."""
    sidecar = _Sidecar()
    sidecar.gate.clear()
    keeper = _keeper(sidecar)
    try:
        old = Lease("a", 3, TTL, receiver_id="r", expires_at=time.monotonic() + TTL / 10)
        keeper.keep(old, renew_now=True)
        assert sidecar.asked.wait(TTL / 3)  # at once, not a third of the TTL later
        taken: list[tuple[Lease, bool]] = []
        taker = threading.Thread(target=lambda: taken.append(keeper.take_back()))
        taker.start()
        time.sleep(0.05)
        assert not taken  # waits for the answer
        sidecar.gate.set()
        taker.join(5)
        ((kept, lost),) = taken
        assert not lost and kept.expires_at > old.expires_at

        sidecar.gate.clear()
        sidecar.asked.clear()
        keeper.keep(replace(old, lease_id="b"), renew_now=True)
        assert sidecar.asked.wait(TTL / 3)
        started = time.monotonic()
        kept, _ = keeper.take_back(wait=False)
        assert time.monotonic() - started < TTL / 10 and kept.lease_id == "b"
        sidecar.gate.set()

        sidecar.error = UnknownLease("lease c ended")
        keeper.keep(replace(old, lease_id="c"), renew_now=True)
        kept, lost = keeper.take_back()
        assert lost and kept.expires_at == old.expires_at
    finally:
        keeper.close()


def test_renewed_counts_the_end_from_the_call_start() -> None:
    sidecar = _Sidecar()
    client: Any = sidecar
    before = time.monotonic()
    fresh = renewed(client, Lease("a", 3, 1.0, receiver_id="r"), 5.0)
    assert before + 5.0 <= fresh.expires_at <= time.monotonic() + 5.0
