"""Rank 0's side of the liveness links (see `runtime/liveness.py`): one thread accepts a link
per other rank, sends heartbeats, and declares the first rank that died or went silent lost."""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from trainer_svc.config import LivenessConfig
from trainer_svc.runtime.liveness import (
    BEAT,
    BYE,
    EXIT_PEER_LOST,
    HELLO,
    Lines,
    PeerLost,
    Terminate,
    exit_process,
    prepare_socket,
    send_line,
)

log = logging.getLogger(__name__)


def _closed_cause(error: OSError | None) -> str:
    if error is None:
        return "died (its link to rank 0 closed without a goodbye)"
    return f"died (its link to rank 0 failed: {error.strerror or error})"


@dataclass
class _Link:
    """Rank 0's end of one rank's link."""

    sock: socket.socket
    heard: float
    lines: Lines
    rank: int | None = None
    """None until the rank said hello."""


class PeerMonitor:
    """Rank 0's side: accepts one link per other rank and watches them all on one thread."""

    def __init__(
        self,
        config: LivenessConfig,
        listener: socket.socket,
        *,
        world_size: int,
        terminate: Terminate,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.world_size = world_size
        self._listener = listener
        self._terminate = terminate
        self._clock = clock
        self._started = clock()
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake = socket.socketpair()
        self._links: dict[socket.socket, _Link] = {}
        self._joined: dict[int, _Link] = {}
        self._left: set[int] = set()
        self._listeners: list[Callable[[PeerLost], None]] = []
        self._lock = threading.Lock()
        self._closing = False
        self.lost: PeerLost | None = None
        self._thread = threading.Thread(target=self._run, name="liveness-monitor", daemon=True)

    @classmethod
    def listen(
        cls,
        config: LivenessConfig,
        *,
        world_size: int,
        host: str,
        terminate: Terminate = exit_process,
        clock: Callable[[], float] = time.monotonic,
    ) -> PeerMonitor:
        """Listens on host, port 0 (`address`); the ranks' connections wait in the backlog
        until `start`."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server((host, 0), family=family, backlog=max(world_size, 16))
        monitor = cls(config, listener, world_size=world_size, terminate=terminate, clock=clock)
        monitor._selector.register(listener, selectors.EVENT_READ)
        monitor._selector.register(monitor._wake_read, selectors.EVENT_READ)
        return monitor

    def start(self) -> None:
        """Starts watching, once every rank has the address: from now on each rank has
        ``peer_timeout_seconds`` to connect."""
        self._started = self._clock()
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    def add_listener(self, listener: Callable[[PeerLost], None]) -> None:
        """Calls `listener(loss)` (on the monitor's thread) when a rank is lost; at once when
        one already was."""
        with self._lock:
            lost = self.lost
            if lost is None:
                self._listeners.append(listener)
        if lost is not None:
            listener(lost)

    def close(self) -> None:
        """Clean shutdown, once every rank finished the Shutdown command: says goodbye to every
        rank and stops watching. After a loss it waits for the exit (`EXIT_PEER_LOST`)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            lost = self.lost
        if lost is None:
            self._wake.send(b"x")
        self._thread.join()
        for link in self._links.values():
            if link.rank is not None and lost is None:
                send_line(link.sock, BYE)
            link.sock.close()
        self._links.clear()
        self._selector.close()
        for sock in (self._listener, self._wake, self._wake_read):
            sock.close()

    # -- the monitor's thread ---------------------------------------------------------------

    def _run(self) -> None:
        period = self.config.heartbeat_seconds
        next_beat = self._clock()
        while True:
            ready = self._selector.select(max(0.0, next_beat - self._clock()))
            now = self._clock()
            for key, _ in ready:
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._wake_read:
                    return  # closing
                if sock is self._listener:
                    self._accept(now)
                    continue
                loss = self._read(self._links[sock], now)
                if loss is not None:
                    self._declare(loss)
                    return
            if now >= next_beat:
                for link in self._joined.values():
                    send_line(link.sock, BEAT)
                next_beat = now + period
            loss = self._overdue(now)
            if loss is not None:
                self._declare(loss)
                return

    def _accept(self, now: float) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        prepare_socket(sock, self.config)
        self._links[sock] = _Link(sock, now, Lines())
        self._selector.register(sock, selectors.EVENT_READ)

    def _drop(self, link: _Link) -> None:
        self._selector.unregister(link.sock)
        del self._links[link.sock]
        if link.rank is not None:
            del self._joined[link.rank]
        link.sock.close()

    def _read(self, link: _Link, now: float) -> PeerLost | None:
        """Reads what one link delivered; returns the loss it shows, if any."""
        error: OSError | None = None
        try:
            data = link.sock.recv(4096)
        except OSError as e:
            data, error = b"", e
        if not data:
            rank = link.rank
            self._drop(link)
            # A link that never said hello is a stranger's (an unjoined rank is overdue).
            return None if rank is None else PeerLost(rank, _closed_cause(error))
        link.heard = now
        try:
            lines = link.lines.feed(data)
        except ValueError as e:
            rank = link.rank
            self._drop(link)
            return None if rank is None else PeerLost(rank, f"broke the liveness protocol ({e})")
        for line in lines:
            if link.rank is None:
                self._hello(link, line)
                if link.rank is None:
                    return None
            elif line == BYE:
                self._left.add(link.rank)
                self._drop(link)
                return None
        return None

    def _hello(self, link: _Link, line: bytes) -> None:
        word, _, number = line.partition(b" ")
        rank = int(number) if word == HELLO and number.isdigit() else None
        if rank is None or not 0 < rank < self.world_size or rank in self._joined:
            log.warning(
                "liveness: dropping a link that said %r (world of %d)", line[:40], self.world_size
            )
            self._drop(link)
            return
        link.rank = rank
        self._joined[rank] = link

    def _overdue(self, now: float) -> PeerLost | None:
        timeout = self.config.peer_timeout_seconds
        for rank, link in self._joined.items():
            if now - link.heard > timeout:
                return PeerLost(
                    rank, f"stopped responding (nothing heard from it for {now - link.heard:.1f} s)"
                )
        for link in [link for link in self._links.values() if link.rank is None]:
            if now - link.heard > timeout:
                self._drop(link)  # connected but never said hello
        if now - self._started > timeout:
            for rank in range(1, self.world_size):
                if rank not in self._joined and rank not in self._left:
                    return PeerLost(rank, f"never connected to rank 0 (waited {timeout:.1f} s)")
        return None

    def _declare(self, loss: PeerLost) -> None:
        with self._lock:
            if self._closing:
                return  # every rank finished the shutdown command: nothing is lost
            self.lost = loss
            listeners, self._listeners = self._listeners, []
        grace = self.config.exit_grace_seconds
        log.error(
            "%s: the world cannot go on; exiting with status %d in %.1f s",
            loss,
            EXIT_PEER_LOST,
            grace,
        )
        for listener in listeners:
            try:
                listener(loss)
            except Exception:
                log.exception("liveness: a listener failed")
        time.sleep(grace)
        self._terminate(EXIT_PEER_LOST)
