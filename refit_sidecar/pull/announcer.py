"""Publishing a pull's progress off its loop (docs/fanout.md, step 4).

As a pull's destination fills in order, two things follow each new prefix: the receiver's own
progress word advances (its children read behind it) and the caller hears of it (the running
check starts the sums of the shards that lie there, a refit prints its progress). On a GPU
both are slow next to the loop that posts and collects reads: a word write is a copy that
waits for the GPU's copy queue (behind the 256 MiB copies queued beside it), and a check
part's start launches kernels from Python. Done in the
loop, they held the next chunks back while the link sat idle.

`ProgressPublisher.offer(prefix, total)` queues the new prefix and returns at once. Two lanes,
each a thread of its own, take the prefixes in order:

- the word lane writes the word, skipping a prefix when a larger one already waits behind it
  (whose write covers it);
- the listener lane tells the listener of every prefix.

The lanes do not wait for each other. In one lane, a check part's launches held the next word
back (traced: a parent stored a fill late after it landed, and its child waited that long
more), while a child needs the word as soon as the bytes are
there; the listener needs nothing from the word (the check sums bytes that landed, whatever a
child was told). The word may run ahead of what the listener was told, or behind it.

A lane's thread is an idle worker of the process (`_Worker`), taken at its first prefix and
idle again when the publisher closes.

`close()` (or leaving a `with` block, where an error of the publications is only logged when
the block itself raised) waits until every prefix offered is published in both lanes, then
ends the lanes: the caller may then finish or restart the copy's word (a fill still queued
on a GPU stream lands before any later store, `progress.Words`). An error in either lane stops
the publications of both after it and is raised by the next `offer` or by `close`.

The lanes share the interpreter with the pull's loop, which polls its reads without blocking: while
it keeps finding progress it would not sleep, and a lane waiting to take the interpreter back after
a launch waited up to its switch interval. `busy` tells the loop to yield a moment at each turn
while a lane has work.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import ClassVar

log = logging.getLogger(__name__)


class _Worker:
    """A thread serving one lane at a time, waiting among the idle workers between lanes. The
    lanes' threads are reused from pull to pull: a thread started per lane and pull was
    waited for on the pull's loop at its first landed chunk, before its children heard of it."""

    _idle: ClassVar[list[_Worker]] = []
    _pid: ClassVar[int] = 0
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[[], None], threading.Event]]
        self._tasks = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="progress", daemon=True).start()

    @classmethod
    def run(cls, task: Callable[[], None]) -> threading.Event:
        """Runs `task` on an idle worker (a new one when none is idle); the event is set once
        it returned and the worker is idle again. A forked child starts its own workers."""
        with cls._lock:
            if cls._pid != os.getpid():
                cls._idle, cls._pid = [], os.getpid()
            worker = cls._idle.pop() if cls._idle else None
        if worker is None:
            worker = cls()
        done = threading.Event()
        worker._tasks.put((task, done))
        return done

    def _loop(self) -> None:
        while True:
            task, done = self._tasks.get()
            try:
                task()
            except BaseException:  # a lane keeps its own errors; this is a bug
                log.exception("a progress lane failed")
            finally:
                with self._lock:
                    self._idle.append(self)
                done.set()


class ProgressPublisher:
    def __init__(
        self,
        word: Callable[[int], None] | None,
        listener: Callable[[int, int], None] | None,
        *,
        name: str = "progress",
    ) -> None:
        """`word(prefix)` and `listener(prefix, total)` each run on a thread of their own, one
        call at a time, with prefixes in the order offered."""
        self._cond = threading.Condition()
        self._lanes: list[_Lane] = []
        if word is not None:
            self._lanes.append(_Lane(self, _prefix_only(word), f"{name}-word", True))
        if listener is not None:
            self._lanes.append(_Lane(self, listener, f"{name}-listener", False))
        self._closing = False
        self._error: BaseException | None = None

    def offer(self, prefix: int, total: int) -> None:
        """Publish `prefix` (of `total` bytes) soon; returns without waiting. Raises the error
        of an earlier publication, if one failed."""
        with self._cond:
            if self._error is not None:
                raise self._error
            if self._closing:
                raise RuntimeError("progress offered after the publisher closed")
            for lane in self._lanes:
                lane.queue.append((prefix, total))
                lane.start()
            self._cond.notify_all()

    @property
    def busy(self) -> bool:
        """Some publication is queued or running (read without the lock: a hint)."""
        return any(lane.queue or lane.running for lane in self._lanes)

    def close(self) -> None:
        """Waits until every prefix offered is published and ends the lanes (their threads go
        idle); raises the first error a publication raised. Idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for lane in self._lanes:
            if lane.served is not None:
                lane.served.wait()
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def __enter__(self) -> ProgressPublisher:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if error is None:
            self.close()
            return
        try:
            self.close()
        except Exception:  # the block's own error is the one to raise
            log.warning("publishing the progress of a failed pull failed", exc_info=True)

    def _serve(self, lane: _Lane) -> None:
        thread = threading.current_thread()
        idle, thread.name = thread.name, lane.name
        try:
            self._serve_lane(lane)
        finally:
            thread.name = idle

    def _serve_lane(self, lane: _Lane) -> None:
        cond = self._cond
        while True:
            with cond:
                while not lane.queue and not self._closing and self._error is None:
                    cond.wait()
                if not lane.queue or self._error is not None:  # closing, or stopped
                    return
                prefix, total = lane.queue.popleft()
                covered = lane.skips_covered and bool(lane.queue)
                lane.running = not covered
            if covered:
                continue
            try:
                lane.call(prefix, total)
                lane.running = False
            except BaseException as e:  # raised to the pull by its next offer or close
                with cond:
                    lane.running = False
                    if self._error is None:
                        self._error = e
                    for other in self._lanes:
                        other.queue.clear()
                    cond.notify_all()
                return


def _prefix_only(word: Callable[[int], None]) -> Callable[[int, int], None]:
    return lambda prefix, _total: word(prefix)


class _Lane:
    """One kind of publication: its queue and the worker serving it (taken at the first
    prefix, so a publisher never offered anything takes none)."""

    def __init__(
        self,
        publisher: ProgressPublisher,
        call: Callable[[int, int], None],
        name: str,
        skips_covered: bool,
    ) -> None:
        self.publisher = publisher
        self.call = call
        self.name = name
        self.skips_covered = skips_covered
        self.queue: deque[tuple[int, int]] = deque()
        self.running = False
        """A call is under way."""
        self.served: threading.Event | None = None
        """Set when the lane's run on a worker (`_Worker`), once taken, ended."""

    def start(self) -> None:
        """Under the publisher's lock."""
        if self.served is None:
            self.served = _Worker.run(lambda: self.publisher._serve(self))
