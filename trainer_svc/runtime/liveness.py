"""Rank liveness, apart from torch.distributed: rank 0 learns at once that a rank died, and
every rank learns that rank 0 did.

A collective with a dead peer fails (gloo) or waits for its 30-minute timeout (NCCL), and only
a rank that runs one finds out. So every other rank keeps one TCP link with rank 0, opened
right after the process group: rank 0 listens on the interface it reaches the rendezvous
through (port 0) and broadcasts the address (`runtime/rank.py`); a rank connects and says
``hello <rank>``, then both ends send a heartbeat every ``heartbeat_seconds``. A process that
dies closes its sockets, so the other end reads EOF (or a reset) at once, whatever its main
thread is blocked in; a hung process or a lost node goes silent, which counts after
``peer_timeout_seconds``.

- Rank 0 (`PeerMonitor`, `runtime/liveness_monitor.py`): the first lost rank is logged once
  and reported to the listeners (the server turns health NOT_SERVING and answers every call
  UNAVAILABLE naming the rank); ``exit_grace_seconds`` later the process exits with
  `EXIT_PEER_LOST`. It exits without joining anything: its command thread may be stuck in a
  collective that never returns.
- Every other rank (`LeaderLink`): exits with `EXIT_PEER_LOST` as soon as rank 0 goes away.
- A clean shutdown says ``bye`` before the sockets close, so it is never taken for a death.

Torch-free, so that it is tested with plain processes and sockets.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from trainer_svc.config import LivenessConfig

log = logging.getLogger(__name__)

EXIT_PEER_LOST = 75
"""Exit status of a rank whose world lost a rank (EX_TEMPFAIL: restart the world, retry)."""

HELLO = b"hello"
BEAT = b"beat"
BYE = b"bye"
MAX_LINE = 64

Terminate = Callable[[int], None]


def exit_process(code: int) -> None:
    """Flushes the logs and ends the process now: threads blocked in a collective cannot be
    joined, and interpreter shutdown would wait for them."""
    with contextlib.suppress(Exception):
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


@dataclass(frozen=True)
class PeerLost:
    """Which rank a world lost, and how it was noticed."""

    rank: int
    cause: str

    def __str__(self) -> str:
        return f"rank {self.rank} {self.cause}"


def reachable_host(master_addr: str, master_port: int) -> str:
    """This host's address on the route to the rendezvous: the other ranks reach the
    rendezvous, so they can reach this address too. Connecting a UDP socket sends nothing;
    it only chooses the route."""
    family, _, _, _, sockaddr = socket.getaddrinfo(
        master_addr, master_port, type=socket.SOCK_DGRAM
    )[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return str(probe.getsockname()[0])


class Lines:
    """Splits a byte stream into lines."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, data: bytes) -> list[bytes]:
        *lines, self._rest = (self._rest + data).split(b"\n")
        if len(self._rest) > MAX_LINE:
            raise ValueError(f"a line longer than {MAX_LINE} bytes")
        return lines


def prepare_socket(sock: socket.socket, config: LivenessConfig) -> None:
    """Sends block at most one heartbeat period (a peer that stops reading is caught by its
    silence) and leave at once (no Nagle delay)."""
    sock.settimeout(config.heartbeat_seconds)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def send_line(sock: socket.socket, line: bytes) -> None:
    """Best effort: a send that fails shows up as the peer's silence or EOF."""
    with contextlib.suppress(OSError):
        sock.sendall(line + b"\n")


class LeaderLink:
    """A rank's link to rank 0: the process exits when rank 0 goes away (the rank is most
    likely blocked in a collective with it)."""

    def __init__(
        self,
        config: LivenessConfig,
        sock: socket.socket,
        *,
        rank: int,
        terminate: Terminate,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.rank = rank
        self._sock = sock
        self._terminate = terminate
        self._clock = clock
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake = socket.socketpair()
        self._lock = threading.Lock()
        self._closing = False
        self.released = False
        """Rank 0 said goodbye: it shuts down cleanly, and closing the link is no loss."""
        self.lost: PeerLost | None = None
        self._thread = threading.Thread(target=self._run, name="liveness-link", daemon=True)

    @classmethod
    def connect(
        cls,
        config: LivenessConfig,
        *,
        rank: int,
        address: tuple[str, int],
        terminate: Terminate = exit_process,
        clock: Callable[[], float] = time.monotonic,
    ) -> LeaderLink:
        """Connects to rank 0's monitor (retrying for ``peer_timeout_seconds``), says hello and
        starts watching."""
        deadline = clock() + config.peer_timeout_seconds
        while True:
            try:
                sock = socket.create_connection(address, timeout=config.peer_timeout_seconds)
                break
            except OSError as e:
                if clock() > deadline:
                    raise ConnectionError(
                        f"rank {rank} cannot reach rank 0's liveness monitor at "
                        f"{address[0]}:{address[1]}: {e}"
                    ) from e
                time.sleep(0.1)
        prepare_socket(sock, config)
        sock.sendall(b"%s %d\n" % (HELLO, rank))
        link = cls(config, sock, rank=rank, terminate=terminate, clock=clock)
        link._selector.register(sock, selectors.EVENT_READ)
        link._selector.register(link._wake_read, selectors.EVENT_READ)
        link._thread.start()
        return link

    def await_loss(self, timeout: float) -> None:
        """Gives the link up to `timeout` seconds to notice that rank 0 is gone, which ends the
        process with `EXIT_PEER_LOST`: a collective failing is often how the loss shows first
        on this rank, and the world's exit status should name it."""
        self._thread.join(timeout)

    def close(self) -> None:
        """Clean shutdown, once this rank finished the Shutdown command: says goodbye and stops
        watching. After a loss it only releases the sockets."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            lost = self.lost
        if lost is None:
            self._wake.send(b"x")
        self._thread.join()
        if lost is None:
            send_line(self._sock, BYE)
        self._selector.close()
        for sock in (self._sock, self._wake, self._wake_read):
            sock.close()

    def _run(self) -> None:
        period = self.config.heartbeat_seconds
        lines = Lines()
        heard = next_beat = self._clock()
        while True:
            ready = self._selector.select(max(0.0, next_beat - self._clock()))
            now = self._clock()
            for key, _ in ready:
                if key.fileobj is self._wake_read:
                    return  # closing
                error: OSError | None = None
                try:
                    data = self._sock.recv(4096)
                except OSError as e:
                    data, error = b"", e
                if not data:
                    cause = "its link closed without a goodbye" if error is None else error
                    self._lose(f"went away ({cause})")
                    return
                heard = now
                try:
                    received = lines.feed(data)
                except ValueError as e:
                    self._lose(f"broke the liveness protocol ({e})")
                    return
                if BYE in received:
                    self.released = True
                    return
            if now - heard > self.config.peer_timeout_seconds:
                self._lose(f"stopped responding (nothing heard from it for {now - heard:.1f} s)")
                return
            if now >= next_beat:
                send_line(self._sock, BEAT)
                next_beat = now + period

    def _lose(self, cause: str) -> None:
        loss = PeerLost(0, cause)
        with self._lock:
            if self._closing:
                return  # this rank finished the shutdown command already
            self.lost = loss
        log.error("%s: rank %d exits with status %d", loss, self.rank, EXIT_PEER_LOST)
        self._terminate(EXIT_PEER_LOST)
