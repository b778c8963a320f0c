"""Rank 0's book of publications: each version settles READABLE or FAILED, a failed one is
handed to the next reservation once (again when that reservation fails), waiting returns once
settled, and the book keeps the last few versions."""

from __future__ import annotations

import threading
import time

from trainer_svc.domain import PublicationState
from trainer_svc.runtime.publication_book import KEPT, PublicationBook


def test_versions_settle_and_failed_ones_are_abandoned_once() -> None:
    book = PublicationBook()
    book.pending(1)
    book.not_published(2)
    book.pending(3)
    book.retrying(3, "rank 1's report failed; retrying")
    assert [p.state for p in book.recent()] == [
        PublicationState.PENDING,
        PublicationState.NOT_PUBLISHED,
        PublicationState.RETRYING,
    ]
    book.readable(1)
    book.failed(3, "ranks [1] did not report version 3 within 10 s")
    failed = book.get(3)
    assert failed is not None and failed.state is PublicationState.FAILED
    assert "did not report" in failed.reason
    assert book.take_abandoned() == (3,)
    assert book.take_abandoned() == ()
    book.give_back((3,))  # the reservation that carried it failed
    assert book.take_abandoned() == (3,)


def test_waiting_returns_once_settled_or_at_the_timeout() -> None:
    book = PublicationBook()
    book.pending(5)
    start = time.monotonic()
    timer = threading.Timer(0.1, book.readable, args=(5,))
    timer.start()
    entry = book.wait(5, timeout=10)
    timer.join()
    assert entry is not None and entry.state is PublicationState.READABLE
    assert time.monotonic() - start < 5
    book.pending(6)
    still = book.wait(6, timeout=0.05)
    assert still is not None and still.state is PublicationState.PENDING
    assert book.wait(99, timeout=0.05) is None


def test_the_book_keeps_the_last_versions() -> None:
    book = PublicationBook()
    for version in range(1, KEPT + 4):
        book.pending(version)
    assert [p.weights_version for p in book.recent()] == list(range(4, KEPT + 4))
