"""Publishing a pull's progress off its loop (docs/fanout.md, step 4).

As a pull's destination fills in order, two things follow each new prefix: the receiver's own
progress word advances (its children read behind it) and the caller hears of it (the running
check starts the sums of the shards that lie there, a refit prints its progress). On a GPU
both are slow next to the loop that posts and collects reads: a word write is a copy that
waits for the GPU's copy queue (0.3-1 ms while 256 MiB copies are queued beside it), and a
check part's start launches kernels from Python (0.5-1.8 ms on a loaded host). Done in the
loop, they held the next chunks back while the link sat idle.

`ProgressPublisher.offer(prefix, total)` queues the new prefix for a thread of its own and
returns at once. The thread takes the prefixes in order: for each it writes the word (unless a
larger prefix waits behind it, whose write covers it) and then tells the listener, so the
listener hears every prefix and the word is never ahead of what the listener was told.
`close()` (or leaving a `with` block, where an error of the publications is only logged when
the block itself raised) waits until every prefix offered is published, then stops the
thread: the caller may
then finish or restart the copy's word (a fill still queued on a GPU stream lands before any
later store, `progress.Words`). An error in
publishing stops the publications after it and is raised by the next `offer` or by `close`.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from types import TracebackType

log = logging.getLogger(__name__)


class ProgressPublisher:
    def __init__(
        self,
        word: Callable[[int], None] | None,
        listener: Callable[[int, int], None] | None,
        *,
        name: str = "progress",
    ) -> None:
        """`word(prefix)` and `listener(prefix, total)` run on the publisher's thread, one call
        at a time, with prefixes in the order offered."""
        self._word = word
        self._listener = listener
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[tuple[int, int]] = deque()
        self._closing = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def offer(self, prefix: int, total: int) -> None:
        """Publish `prefix` (of `total` bytes) soon; returns without waiting. Raises the error
        of an earlier publication, if one failed."""
        with self._cond:
            if self._error is not None:
                raise self._error
            if self._closing:
                raise RuntimeError("progress offered after the publisher closed")
            self._queue.append((prefix, total))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def close(self) -> None:
        """Waits until every prefix offered is published and stops the thread; raises the
        first error a publication raised. Idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()
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

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue or self._error is not None:  # closing, or stopped
                    return
                prefix, total = self._queue.popleft()
                covered = bool(self._queue)
            try:
                if self._word is not None and not covered:
                    self._word(prefix)
                if self._listener is not None:
                    self._listener(prefix, total)
            except BaseException as e:  # raised to the pull by its next offer or close
                with self._cond:
                    self._error = e
                    self._queue.clear()
