"""A pull's timeline, recorded when asked for (`ChunkConfig.trace`, `RefitOptions.trace_pull`).

What a chain of receivers does between its first and last read decides how much each level
adds (docs/fanout.md): when each chunk was posted and landed, when each look at a parent
showed more of its copy, when this receiver's own fill was stored for its children, when its
check's parts started and when the check ended. `PullTrace` keeps those events with their
wall-clock times (one clock per host, so the receivers of one host line up); the pull's stats
carry them, and `benchmarks/refit_fanout.py --trace` prints each level's lag from them.
Recording costs a tuple append per event; off, nothing.
"""

from __future__ import annotations

import enum
import time


class TraceEvent(enum.Enum):
    BEGAN = "began"
    """The pull began, its plan in hand ("", 0)."""
    ANSWERED = "answered"
    """The sidecar's answer (sources) was in hand ("", 0)."""
    RESET = "reset"
    """This receiver's own copy was reset for the version, before its first read ("", 0)."""
    PREPARED = "prepared"
    """Direct pull: its requests were prepared, none posted yet ("", requests)."""
    POSTED = "posted"
    """A chunk request was posted (source, bytes)."""
    LANDED = "landed"
    """A chunk request landed (source, bytes)."""
    SAW = "saw"
    """A look at a peer's progress showed more of its copy (peer, bytes filled); direct pull
    behind the trainer's snapshot copy: the first look at the sources' pieces landed ("",
    pieces holding the version)."""
    READABLE = "readable"
    """Direct pull behind the trainer's snapshot copy: its gate opened on the sidecar's word
    that the version is readable, before a look at the pieces did ("", 0); that may be while
    the early pull was planned, before it began."""
    FILLED = "filled"
    """This receiver began storing its own fill for its children ("", bytes filled)."""
    CHECK_TOLD = "check_told"
    """The running check is told how far the destination holds ("", bytes), on the listener's
    thread; what it starts there follows."""
    CHECK_STARTED = "check_started"
    """The running check started the sums of what lies there ("", bytes)."""
    VERIFIED = "verified"
    """The check of the whole pull ended ("", shards checked)."""


Event = tuple[float, str, str, int]
"""(time.time(), event, source or peer, bytes or count)."""


class PullTrace:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def add(
        self, event: TraceEvent, source: str = "", value: int = 0, *, at: float | None = None
    ) -> None:
        """Safe from any thread (one list append). `at`: when it happened (time.time()),
        if not now; the events then need sorting by time."""
        self.events.append((time.time() if at is None else at, event.value, source, value))
