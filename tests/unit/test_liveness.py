"""Rank liveness with plain processes and sockets (no torch): a killed rank is reported at once,
a silent one after the timeout, rank 0 going away ends every rank with EXIT_PEER_LOST, and
goodbyes are never taken for deaths."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainer_svc.cli import parse_config
from trainer_svc.config import LivenessConfig
from trainer_svc.runtime.liveness import EXIT_PEER_LOST, PeerLost, reachable_host
from trainer_svc.runtime.liveness_monitor import PeerMonitor

ROOT = Path(__file__).resolve().parents[2]

# One side of the links in a process of its own: rank 0 prints its port, another rank prints
# "joined"; a line on stdin shuts the side down cleanly.
_SIDE = textwrap.dedent(
    """
    import logging, sys
    from trainer_svc.config import LivenessConfig
    from trainer_svc.runtime.liveness import LeaderLink
    from trainer_svc.runtime.liveness_monitor import PeerMonitor

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rank, world, port = (int(arg) for arg in sys.argv[1:4])
    timeout = float(sys.argv[4])
    config = LivenessConfig(
        heartbeat_seconds=0.1, peer_timeout_seconds=timeout, exit_grace_seconds=0.0
    )
    if rank == 0:
        side = PeerMonitor.listen(config, world_size=world, host="127.0.0.1")
        side.start()
        print(side.address[1], flush=True)
    else:
        side = LeaderLink.connect(config, rank=rank, address=("127.0.0.1", port))
        print("joined", flush=True)
    sys.stdin.readline()
    side.close()
    """
)


class Side:
    """A rank's side of the liveness links, in a process of its own."""

    def __init__(self, rank: int, *, world: int, port: int = 0, timeout: float = 30.0) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SIDE, str(rank), str(world), str(port), str(timeout)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.process.stdout is not None
        self.ready = self.process.stdout.readline().strip()
        assert self.ready, self.process.communicate()[1]

    def shut_down(self) -> int:
        """Asks for a clean shutdown; returns the exit status."""
        _, err = self.process.communicate("\n", timeout=10)
        assert self.process.returncode == 0, err
        return self.process.returncode

    def exit_status(self, within: float) -> tuple[int, str]:
        """Waits for the process to exit by itself (stdin stays open); its status and log."""
        status = self.process.wait(timeout=within)
        assert self.process.stderr is not None
        return status, self.process.stderr.read()

    def signal(self, sig: signal.Signals) -> None:
        self.process.send_signal(sig)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.communicate()


class Rank0:
    """Rank 0's monitor in the test process: losses and exit requests are recorded."""

    def __init__(
        self, *, world: int, timeout: float, grace: float = 0.2, start: bool = True
    ) -> None:
        config = LivenessConfig(
            heartbeat_seconds=0.1, peer_timeout_seconds=timeout, exit_grace_seconds=grace
        )
        self.exits: queue.Queue[int] = queue.Queue()
        self.losses: queue.Queue[PeerLost] = queue.Queue()
        self.monitor = PeerMonitor.listen(
            config, world_size=world, host="127.0.0.1", terminate=self.exits.put
        )
        if start:
            self.monitor.start()
        self.monitor.add_listener(self.losses.put)
        self.port = self.monitor.address[1]

    def next_loss(self, within: float) -> tuple[PeerLost, float]:
        start = time.monotonic()
        loss = self.losses.get(timeout=within)
        return loss, time.monotonic() - start


@pytest.fixture
def sides() -> Iterator[list[Side]]:
    started: list[Side] = []
    yield started
    for side in started:
        side.kill()


def test_a_killed_rank_is_reported_at_once_then_rank_0_exits(sides: list[Side]) -> None:
    rank0 = Rank0(world=3, timeout=30.0)
    sides += [Side(rank, world=3, port=rank0.port) for rank in (1, 2)]
    sides[1].signal(signal.SIGKILL)
    loss, waited = rank0.next_loss(within=10)
    assert loss.rank == 2 and "died" in loss.cause, loss
    assert str(loss).startswith("rank 2 died")
    assert waited < 5, "a closed link is noticed at once, not after the 30 s timeout"
    assert rank0.exits.get(timeout=5) == EXIT_PEER_LOST
    assert rank0.monitor.lost == loss
    late: queue.Queue[PeerLost] = queue.Queue()
    rank0.monitor.add_listener(late.put)
    assert late.get_nowait() == loss
    assert sides[0].process.poll() is None
    rank0.monitor.close()


def test_a_silent_rank_is_reported_after_the_timeout(sides: list[Side]) -> None:
    rank0 = Rank0(world=2, timeout=2.0, start=False)
    sides.append(Side(1, world=2, port=rank0.port))
    rank0.monitor.start()
    sides[0].signal(signal.SIGSTOP)
    loss, waited = rank0.next_loss(within=10)
    assert loss.rank == 1 and loss.cause.startswith("stopped responding"), loss
    assert 1.8 <= waited < 6
    assert rank0.exits.get(timeout=5) == EXIT_PEER_LOST
    rank0.monitor.close()


def test_goodbyes_are_not_losses(sides: list[Side]) -> None:
    rank0 = Rank0(world=3, timeout=1.0, start=False)
    sides += [Side(rank, world=3, port=rank0.port) for rank in (1, 2)]
    time.sleep(1.1)
    rank0.monitor.start()  # the ranks that connected meanwhile are in time
    assert sides[1].shut_down() == 0
    time.sleep(1.0)
    assert rank0.losses.empty() and rank0.monitor.lost is None
    rank0.monitor.close()  # says goodbye: rank 1 does not exit when the link then closes
    time.sleep(1.0)
    assert sides[0].process.poll() is None
    assert sides[0].shut_down() == 0
    assert rank0.exits.empty()


@pytest.mark.parametrize(
    ("how", "world", "timeout", "cause"),
    [(signal.SIGKILL, 3, 30.0, "went away"), (signal.SIGSTOP, 2, 2.0, "stopped responding")],
    ids=["killed", "hung"],
)
def test_every_rank_exits_when_rank_0_is_gone(
    sides: list[Side], how: signal.Signals, world: int, timeout: float, cause: str
) -> None:
    sides.append(Side(0, world=world, timeout=timeout))
    port = int(sides[0].ready)
    sides += [Side(rank, world=world, port=port, timeout=timeout) for rank in range(1, world)]
    sides[0].signal(how)
    start = time.monotonic()
    for side in sides[1:]:
        status, log = side.exit_status(within=15)
        assert status == EXIT_PEER_LOST, log
        assert f"rank 0 {cause}" in log, log
    bound = 5.0 if how is signal.SIGKILL else timeout + 4.0  # killed: at once, not at 30 s
    assert time.monotonic() - start < bound


def test_a_rank_that_never_connects_is_reported_and_strangers_are_dropped() -> None:
    rank0 = Rank0(world=2, timeout=1.0)
    for said in (b"hello 9\n", b"hello 0\n", b"GET / HTTP/1.1\r\n\r\n", b"x" * 100):
        with socket.create_connection(("127.0.0.1", rank0.port), timeout=5) as stranger:
            stranger.sendall(said)
            assert stranger.recv(16) == b"", f"a link that said {said!r} must be dropped"
    loss, _ = rank0.next_loss(within=10)
    assert loss == PeerLost(1, "never connected to rank 0 (waited 1.0 s)")
    assert rank0.exits.get(timeout=5) == EXIT_PEER_LOST
    rank0.monitor.close()


def test_rank_0_listens_where_the_rendezvous_is_reached() -> None:
    assert reachable_host("127.0.0.1", 29500) == "127.0.0.1"
    assert reachable_host("localhost", 29500) in ("127.0.0.1", "::1")


def test_config_defaults_and_flag() -> None:
    defaults = LivenessConfig()
    assert defaults.peer_timeout_seconds <= 10  # a silent rank is declared dead within 10 s
    config, _ = parse_config(["--insecure", "--peer-timeout-seconds", "2.5"])
    assert config.liveness == LivenessConfig(peer_timeout_seconds=2.5)
    assert parse_config(["--insecure"])[0].liveness == defaults


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"heartbeat_seconds": 0.0}, "heartbeat_seconds must be > 0, got 0.0"),
        ({"peer_timeout_seconds": 1.5}, r"at least twice heartbeat_seconds \(1.0\), got 1.5"),
        ({"peer_timeout_seconds": float("inf")}, "peer_timeout_seconds must be finite"),
        ({"exit_grace_seconds": -1.0}, "exit_grace_seconds must be >= 0, got -1.0"),
    ],
)
def test_invalid_config_is_refused(fields: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LivenessConfig(**fields)


def test_an_invalid_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_config(["--insecure", "--peer-timeout-seconds", "0.5"])
    assert info.value.code == 2
    assert "peer_timeout_seconds must be finite and at least twice" in capsys.readouterr().err
