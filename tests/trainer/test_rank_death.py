"""A dead rank is noticed by rank 0 itself, under torchrun or the local launcher: health turns
NOT_SERVING within 10 s, calls (the one in flight included) answer UNAVAILABLE naming the rank,
and the world exits non-zero so that the orchestrator restarts it. A clean shutdown is no death.

Torchrun-style worlds are started as torchrun starts them: one process per rank with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT, the rendezvous store held by this process (as
torchrun's agent holds it)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.auth import Tokens
from tests.support.batches import make_batch
from tests.support.trainer import TEST_ENV, TrainerProcess
from trainer_refit.auth import Role, open_channel
from trainer_refit.v1 import trainer_pb2_grpc
from trainer_svc.client import TrainerClient
from trainer_svc.domain import LossConfig
from trainer_svc.launch import rendezvous_store
from trainer_svc.runtime.liveness import EXIT_PEER_LOST

BATCH = make_batch(seed=5, lengths=[9, 14], loss=LossConfig())
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# What the liveness links log when they lose a rank.
LOSS_LINE = re.compile(r"rank \d+ (died|stopped responding|never connected|went away)")


class TorchrunWorld:
    """A TP=2 world, one `python -m trainer_svc` process per rank."""

    def __init__(self, workdir: Path) -> None:
        self.store = rendezvous_store()
        tokens = Tokens.create(workdir / "tokens")
        port_file = workdir / "port"
        self.logs = [workdir / f"rank{rank}.log" for rank in range(2)]
        self.ranks: list[subprocess.Popen[bytes]] = []
        for rank, log in enumerate(self.logs):
            env = {
                **os.environ,
                **TEST_ENV,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(self.store.port),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "OMP_NUM_THREADS": "1",
            }
            command = [sys.executable, "-m", "trainer_svc", "--tp", "2", "--host", "127.0.0.1"]
            command += ["--port", "0", "--port-file", str(port_file)]
            command += ["--work-dir", str(workdir / f"rank{rank}"), *tokens.server_args()]
            with log.open("wb") as out:
                self.ranks.append(
                    subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
                )
        while not port_file.exists():
            for rank, process in enumerate(self.ranks):
                assert process.poll() is None, f"rank {rank} exited early:\n{self.log(rank)}"
            time.sleep(0.2)
        target = f"127.0.0.1:{port_file.read_text()}"
        auth = tokens.client(Role.ORCHESTRATOR)
        self.client = TrainerClient(target, auth=auth)
        self.channel = open_channel(target, auth)
        self.stub = trainer_pb2_grpc.TrainerServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace")

    def close(self) -> None:
        self.client.close()
        self.channel.close()
        for process in self.ranks:
            if process.poll() is None:
                process.kill()
            process.wait()


@pytest.fixture
def torchrun_world(tmp_path: Path):
    world = TorchrunWorld(tmp_path)
    yield world
    world.close()


def _health(stub: health_pb2_grpc.HealthStub) -> int:
    return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def _unavailable(call) -> str:
    """Runs the call; it must answer UNAVAILABLE. Returns the details."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
    return info.value.details() or ""


def test_a_killed_rank_ends_the_world_under_torchrun(torchrun_world: TorchrunWorld) -> None:
    world = torchrun_world
    assert _health(world.health) == SERVING
    world.client.forward(BATCH)
    # Rank 1 stops, so a Forward blocks rank 0 inside the command's collectives; then it dies.
    world.ranks[1].send_signal(signal.SIGSTOP)
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(world.client.forward, BATCH)
        time.sleep(1.0)
        assert not in_flight.done(), "rank 0 cannot finish a Forward without rank 1"
        world.ranks[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        details = _unavailable(in_flight.result)
    assert re.match(r"rank 1 died\b", details), details
    while _health(world.health) != NOT_SERVING:
        assert time.monotonic() - killed < 10, "health must turn NOT_SERVING within 10 s"
        time.sleep(0.2)
    assert _health(world.health) == NOT_SERVING
    assert "rank 1" in _unavailable(lambda: world.client.forward(BATCH))
    assert "rank 1" in _unavailable(world.client.status)
    assert world.ranks[0].wait(timeout=30) == EXIT_PEER_LOST
    assert time.monotonic() - killed < 15, "rank 0 exits a few seconds after the death"
    losses = [line for line in world.log(0).splitlines() if "the world cannot go on" in line]
    assert len(losses) == 1 and "ERROR rank 1 died" in losses[0], world.log(0)


def test_a_clean_shutdown_is_no_death(torchrun_world: TorchrunWorld) -> None:
    world = torchrun_world
    world.client.forward(BATCH)
    assert world.client.status().weights_version == 0
    world.ranks[0].send_signal(signal.SIGTERM)
    assert [rank.wait(timeout=60) for rank in world.ranks] == [0, 0]
    for rank in range(2):
        assert not LOSS_LINE.search(world.log(rank)), world.log(rank)


def test_the_other_ranks_exit_when_rank_0_is_killed(tmp_path: Path) -> None:
    """Rank 1 notices by itself and exits at once; the launcher, which leaves the ranks time
    to do that before it steps in, exits with the killed rank's status."""
    trainer = TrainerProcess(tmp_path, ["--tp", "2"])
    trainer.client.forward(BATCH)
    os.kill(_ranks_of(trainer.process.pid)[0], signal.SIGKILL)
    killed = time.monotonic()
    assert trainer.process.wait(timeout=30) == 128 + signal.SIGKILL
    assert time.monotonic() - killed < 10, "rank 1 must not wait for the launcher to stop it"
    log = trainer.log_path.read_text(errors="replace")
    assert "rank 0 went away" in log, log
    assert f"rank 1 exited with status {EXIT_PEER_LOST}" in log, log
    trainer.stop()


def _ranks_of(launcher: int) -> dict[int, int]:
    """The launcher's rank processes: rank -> pid, from the names the launcher gives them
    (Linux /proc)."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    ranks = {}
    for pid in map(int, children):
        name = Path(f"/proc/{pid}/comm").read_text().strip()
        assert name.startswith("trainer-rank"), name
        ranks[int(name.removeprefix("trainer-rank"))] = pid
    return ranks
