"""A pull's READ requests in flight over NIXL (`NixlTransport.start`): posted in destination
order through a window of `NixlConfig.requests_in_flight` and the pull's gate, polled until
every one has landed, each landing reported as a prefix of the destination; a source that
fails, or a pull past its deadline, ends it with `SourceLost` after its other requests are
cancelled.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn, Protocol

import numpy as np
from nixl import _bindings

from refit_sidecar.core.manifest import MemType
from refit_sidecar.memory.region import Region
from refit_sidecar.pull.trace import PullTrace, TraceEvent
from refit_sidecar.pull.transport import Gate, PullStats, SourceLost

NIXL_ERRORS: tuple[type[BaseException], ...] = tuple(
    v for k, v in vars(_bindings).items() if k.startswith("nixl") and k.endswith("Error")
)


@dataclass(eq=False)
class Xfer:
    """A prepared READ request (NIXL's handle and descriptor lists), cached by `key`."""

    key: bytes
    agent: str
    dest: Region
    handle: Any
    dlists: tuple[Any, ...]
    reads: int
    nbytes: int
    done: bool = False


def release_xfer(xfer: Xfer) -> bool:
    """Release a request (cancelling it if in flight) and its lists; False if NIXL refused."""
    ok = True
    for thing in (xfer.handle, *xfer.dlists):
        try:
            thing.release()
        except NIXL_ERRORS:
            ok = False
    return ok


GATED_PAUSE_S = 2e-5
"""The longest pause of a pull's loop while requests wait on its gate."""

LONGEST_PAUSE_S = {MemType.DRAM: 1e-3, MemType.VRAM: 1e-4}
"""The longest pause of a pull's loop between looks at its requests, by the destination's
memory (the pause doubles while nothing lands): into device memory a request lands in about
as long as the host's longest pause, which would leave a landed request (the last one, or
one whose successor waits for the window) unseen for most of a request's time; host memory
fills several times slower."""


class Owner(Protocol):
    """What a pending pull uses of the transport that started it (`NixlTransport`): its NIXL
    agent, its prepared requests and loaded agents, to drop after a source failed, and the
    destination's registration."""

    @property
    def _agent(self) -> Any: ...

    _xfers: OrderedDict[bytes, Xfer]
    _metadata: dict[str, bytes]

    def _forget_agent(self, name: str) -> None: ...

    def deregister(self, dest: Region) -> None: ...


@dataclass(eq=False)
class PendingPull:
    """A pull's READ requests in flight (`NixlTransport.start`): posted in order as its window
    and its gate let them, polled until every one landed."""

    transport: Owner
    deadline: float
    begin: float
    temporary: bool
    """The destination was registered for this pull only: deregister it at the end."""
    dest: Region
    window: int
    """Requests in flight at once."""
    gate: Gate | None = None
    longest_pause: float = LONGEST_PAUSE_S[MemType.DRAM]
    """The longest pause between looks at the requests (`LONGEST_PAUSE_S`)."""
    xfers: list[Xfer] = field(default_factory=list)
    reposted: int = 0
    """Requests taken from the cache (prepared by an earlier pull)."""
    spans: list[tuple[np.ndarray, int]] = field(default_factory=list)
    """Per request: where its reads start in the destination, and its index in `xfers`."""
    queued: deque[tuple[Xfer, int]] = field(default_factory=deque)
    """Requests prepared but not posted yet (`NixlConfig.requests_in_flight`, or held back by
    the gate), in order, each with what it waits for at the gate."""
    posted: list[Xfer] = field(default_factory=list)
    """Requests posted and not seen done."""
    gated_s: float = 0.0
    """With a gate: seconds from the start until its first request was posted."""
    trace: PullTrace | None = None

    def post(self, xfer: Xfer) -> None:
        """Posts a prepared request (NIXL errors are the caller's)."""
        xfer.done = self.transport._agent.transfer(xfer.handle) == "DONE"
        if self.trace is not None:
            self.trace.add(TraceEvent.POSTED, xfer.agent, xfer.nbytes)
            if xfer.done:  # done when posted (host memory, read in the call)
                self.trace.add(TraceEvent.LANDED, xfer.agent, xfer.nbytes)
        if not xfer.done:
            self.posted.append(xfer)

    @property
    def in_flight(self) -> bool:
        return not all(x.done for x in self.xfers)

    def wait(
        self,
        on_landed: Callable[[int], None] | None = None,
        idle: Callable[[], bool] | None = None,
    ) -> PullStats:
        """Poll every request until all are done; SourceLost on an error or the deadline.
        `on_landed(n)`: every byte the pull writes before offset `n` of the destination has
        landed (called as `n` grows, last with the destination's size). `idle()`: work to do
        while requests are in flight, called at turns where the pull would pause until it
        returns True (it must not raise)."""
        agent = self.transport._agent
        waiting = self.posted
        landed = _Landed(self, on_landed) if on_landed is not None else None
        gate = self.gate
        pause = 0.0
        while waiting or self.queued:
            for xfer in list(waiting):
                try:
                    state = agent.check_xfer_state(xfer.handle)
                except NIXL_ERRORS as e:
                    self.fail(xfer.agent, e)
                if state == "ERR":
                    self.fail(xfer.agent, SourceLost(f"{xfer.agent}: transfer failed"))
                if state == "DONE":
                    xfer.done = True
                    waiting.remove(xfer)
                    pause = 0.0
                    if self.trace is not None:
                        self.trace.add(TraceEvent.LANDED, xfer.agent, xfer.nbytes)
            held = self._post_queued(waiting)
            if landed is not None:
                landed.report()
            if held:
                assert gate is not None
                try:
                    gate.poll({x.agent for x, need in self.queued if not gate.ready(x.agent, need)})
                except (SourceLost, TimeoutError) as e:
                    self.fail(getattr(e, "agent", None) or self.queued[0][0].agent, e)
                if self._post_queued(waiting):
                    # A short pause, not a spin: receivers on a busy host (an engine's workers,
                    # the trainer's ranks serving the reads) share the cores. With the words
                    # checked back to back, a two-worker engine's pull in the CPU test suite
                    # ran past its deadline.
                    time.sleep(min(pause, GATED_PAUSE_S))
                    pause = min(2 * pause or 1e-5, 1e-3)
                    continue
            if waiting:
                if time.perf_counter() > self.deadline:
                    late = waiting[0].agent
                    self.fail(late, SourceLost(f"{late}: pull not done by its deadline"))
                if idle is not None and idle():
                    idle = None
                    continue  # it took its time: look at the requests again at once
                time.sleep(pause)
                pause = min(2 * pause or 1e-5, self.longest_pause)
        if landed is not None:
            landed.report()
        self._end()
        seconds, xfers = time.perf_counter() - self.begin, self.xfers
        nbytes, reads = sum(x.nbytes for x in xfers), sum(x.reads for x in xfers)
        stats = PullStats(nbytes, seconds, reads, len(xfers), self.reposted, gated_s=self.gated_s)
        stats = traced(stats, self.trace)
        seen = None if self.gate is None else self.gate.first_seen
        if seen is None:
            return stats
        assert self.gate is not None
        return replace(
            stats,
            gate_first_s=seen[0] - self.begin,
            gate_first_pieces=seen[1],
            gate_rounds=self.gate.rounds,
        )

    def _post_queued(self, waiting: list[Xfer]) -> bool:
        """Posts queued requests, in order, while the window has room and the gate lets the
        next one; True when the gate holds one back."""
        gate = self.gate
        while self.queued and len(waiting) < self.window:
            xfer, need = self.queued[0]
            if gate is not None and not gate.ready(xfer.agent, need):
                return True
            self.queued.popleft()
            try:
                self.post(xfer)
            except NIXL_ERRORS as e:
                self.fail(xfer.agent, e)
            if gate is not None and not self.gated_s:
                self.gated_s = time.perf_counter() - self.begin
        return False

    def fail(self, agent: str, error: BaseException) -> NoReturn:
        """`agent` let this pull down: cancel its other unfinished requests, disconnect `agent`
        (it reconnects on next use), and raise SourceLost."""
        transport = self.transport
        for xfer in self.xfers:
            if not xfer.done and xfer.agent != agent and xfer.agent in transport._metadata:
                transport._xfers.pop(xfer.key, None)
                if not release_xfer(xfer):
                    transport._forget_agent(xfer.agent)
        transport._forget_agent(agent)
        self._end()
        if isinstance(error, SourceLost):
            error.agent = error.agent or agent
            raise error
        if isinstance(error, TimeoutError):  # the gate's: its sources never got ready
            raise error
        raise SourceLost(f"{agent}: {error}", agent=agent) from error

    def _end(self) -> None:
        if self.gate is not None:
            self.gate.settle()
        if self.temporary:
            self.transport.deregister(self.dest)


def traced(stats: PullStats, trace: PullTrace | None) -> PullStats:
    return stats if trace is None else replace(stats, trace=tuple(sorted(trace.events)))


class _Landed:
    """How far from its start a pull's destination holds every byte the pull writes: up to
    the first read whose request is not done (bytes no read covers count as landed)."""

    def __init__(self, pending: PendingPull, on_landed: Callable[[int], None]) -> None:
        self._on_landed = on_landed
        starts = [s for s, _ in pending.spans]
        owners = [np.full(len(s), i) for s, i in pending.spans]
        order = np.argsort(np.concatenate(starts), kind="stable") if starts else np.zeros(0, int)
        self._starts: list[int] = np.concatenate(starts)[order].tolist() if starts else []
        self._owners: list[int] = np.concatenate(owners)[order].tolist() if owners else []
        self._xfers = pending.xfers
        self._end = pending.dest.nbytes
        self._next = 0
        self.prefix = 0

    def report(self) -> None:
        """Tells `on_landed` the prefix, when it moved since the last call."""
        k = self._next
        while k < len(self._starts) and self._xfers[self._owners[k]].done:
            k += 1
        self._next = k
        prefix = self._starts[k] if k < len(self._starts) else self._end
        if prefix > self.prefix:
            self.prefix = prefix
            self._on_landed(prefix)
