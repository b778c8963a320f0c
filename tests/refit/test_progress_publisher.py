"""A pull's progress published from a thread of its own (`progress_publisher.py`)."""

from __future__ import annotations

import threading

import pytest

from refit_sidecar.progress_publisher import ProgressPublisher


def test_every_prefix_is_heard_in_order_and_the_word_is_never_ahead_of_the_listener() -> None:
    events: list[tuple[str, int]] = []
    called, release = threading.Event(), threading.Event()

    def listener(prefix: int, total: int) -> None:
        assert total == 100
        events.append(("heard", prefix))
        called.set()
        release.wait(5)  # the first call holds the thread while more prefixes queue

    publisher = ProgressPublisher(lambda p: events.append(("word", p)), listener)
    publisher.offer(10, 100)
    assert called.wait(5)
    for prefix in (20, 30, 40):
        publisher.offer(prefix, 100)  # returns at once, the listener still blocked
    assert ("heard", 40) not in events
    release.set()
    publisher.close()
    heard = [p for kind, p in events if kind == "heard"]
    words = [p for kind, p in events if kind == "word"]
    assert heard == [10, 20, 30, 40]
    # 20 and 30 waited behind 40 when their turn came: 40's write covers them.
    assert words == [10, 40]
    # Each word is written before the listener hears its prefix, never after a later one.
    assert events.index(("word", 40)) == events.index(("heard", 30)) + 1


def test_close_waits_for_the_last_prefix_and_nothing_is_written_after_it() -> None:
    words: list[int] = []
    gate = threading.Event()

    def word(prefix: int) -> None:
        gate.wait(5)
        words.append(prefix)

    publisher = ProgressPublisher(word, None)
    publisher.offer(7, 7)
    threading.Timer(0.05, gate.set).start()
    publisher.close()
    assert words == [7]
    with pytest.raises(RuntimeError, match="after the publisher closed"):
        publisher.offer(8, 8)
    publisher.close()  # idempotent
    assert words == [7]


def test_an_error_stops_the_publications_and_reaches_the_pull() -> None:
    heard: list[int] = []

    def listener(prefix: int, total: int) -> None:
        if prefix == 2:
            raise OSError("the word's memory is gone")
        heard.append(prefix)

    publisher = ProgressPublisher(None, listener)
    publisher.offer(1, 9)
    publisher.offer(2, 9)
    publisher.offer(3, 9)
    with pytest.raises(OSError, match="memory is gone"):
        publisher.close()
    assert heard == [1]
    # Raised by the next offer when the pull is still running.
    publisher = ProgressPublisher(None, listener)
    publisher.offer(2, 9)
    with pytest.raises(OSError, match="memory is gone"):
        for _ in range(1000):  # until the thread got to it
            publisher.offer(3, 9)
            threading.Event().wait(0.001)
    with pytest.raises(OSError):
        publisher.close()
    # A publisher never offered anything closes at once, with no thread.
    ProgressPublisher(None, None).close()


def test_a_with_block_raises_its_own_error_over_a_publications(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def listener(prefix: int, total: int) -> None:
        raise OSError("the word's memory is gone")

    with (
        pytest.raises(ValueError, match="the pull's own"),
        ProgressPublisher(None, listener) as publisher,
    ):
        publisher.offer(1, 2)
        raise ValueError("the pull's own error")
    assert "the word's memory is gone" in caplog.text
    # Without an error of its own, the block raises the publication's.
    with (
        pytest.raises(OSError, match="memory is gone"),
        ProgressPublisher(None, listener) as publisher,
    ):
        publisher.offer(1, 2)
