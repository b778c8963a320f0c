"""A pull's progress published from a thread of its own (`progress_publisher.py`)."""

from __future__ import annotations

import threading

import pytest

from refit_sidecar.pull.announcer import ProgressPublisher


def test_every_prefix_is_heard_in_order_and_a_slow_listener_holds_no_word_back() -> None:
    heard: list[int] = []
    words: list[int] = []
    wrote = threading.Condition()
    called, release = threading.Event(), threading.Event()

    def listener(prefix: int, total: int) -> None:
        assert total == 100
        heard.append(prefix)
        called.set()
        release.wait(5)  # the first call holds its lane while more prefixes queue

    def word(prefix: int) -> None:
        with wrote:
            words.append(prefix)
            wrote.notify_all()

    publisher = ProgressPublisher(word, listener)
    publisher.offer(10, 100)
    assert called.wait(5)
    for prefix in (20, 30, 40):
        publisher.offer(prefix, 100)  # returns at once, the listener still blocked
    # The word reaches the last prefix while the listener still holds the first.
    with wrote:
        assert wrote.wait_for(lambda: words and words[-1] == 40, timeout=5)
    assert heard == [10]
    release.set()
    publisher.close()
    assert heard == [10, 20, 30, 40]
    # Words go out in order, each an offered prefix; one a larger prefix already waiting
    # behind it covers is skipped (which ones depends on when the word's thread ran).
    assert words == sorted(set(words)) and set(words) <= {10, 20, 30, 40}
    assert words[-1] == 40


def test_the_publisher_is_busy_while_a_publication_is_queued_or_running() -> None:
    called, release = threading.Event(), threading.Event()

    def listener(prefix: int, total: int) -> None:
        called.set()
        release.wait(5)

    publisher = ProgressPublisher(None, listener)
    assert not publisher.busy
    publisher.offer(1, 2)
    assert publisher.busy  # queued, or running
    assert called.wait(5)
    assert publisher.busy  # running
    release.set()
    publisher.close()
    assert not publisher.busy


def test_a_slow_word_holds_no_listener_back() -> None:
    heard = threading.Event()
    release = threading.Event()
    publisher = ProgressPublisher(lambda _: release.wait(5), lambda p, t: heard.set())
    publisher.offer(1, 2)
    assert heard.wait(5)  # while the word's write is still blocked
    release.set()
    publisher.close()


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
    assert not publisher.busy  # a publication that raised is no longer running
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


def test_a_pulls_lanes_reuse_the_threads_of_earlier_pulls() -> None:
    """No thread starts per pull: the next publisher's lanes run on the threads the last one
    handed back, named after the lane while they serve it."""
    seen: list[tuple[int, str]] = []

    def listener(prefix: int, total: int) -> None:
        seen.append((threading.get_ident(), threading.current_thread().name))

    for _ in range(5):
        with ProgressPublisher(None, listener, name="pull") as publisher:
            publisher.offer(1, 1)
    assert {name for _, name in seen} == {"pull-listener"}
    assert len({ident for ident, _ in seen}) == 1, seen
