"""Starts a real trainer-svc world (gRPC on port 0, bearer tokens on) for tests and stops it
cleanly. Its client, channel and stub send the orchestrator role's token; `tokens` has the
other roles' too (which the trainer refuses)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil

from megatron_hf.checkpoint import load_hf_state_dict
from tests.support.auth import Tokens
from trainer_refit.auth import Role, open_channel
from trainer_refit.v1 import trainer_pb2_grpc
from trainer_svc.client import TrainerClient
from trainer_svc.domain import ExportDType

TEST_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
TEST_PEER_TIMEOUT_S = 60.0
"""Test trainers' liveness limit: on a two-core machine running two test workers, a rank
starved of the CPU by the other worker's stack can stay silent past the default; a rank that
dies is still seen at once (its connection closes)."""


class TrainerProcess:
    def __init__(self, workdir: Path, args: Sequence[str]) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.port_file = workdir / "port"
        self.log_path = workdir / "trainer.log"
        self.tokens = Tokens.create(workdir / "tokens")
        self.auth = self.tokens.client(Role.ORCHESTRATOR)
        env = {**os.environ, **TEST_ENV}
        command = [sys.executable, "-m", "trainer_svc", "--port", "0", "--host", "127.0.0.1"]
        command += ["--port-file", str(self.port_file), "--work-dir", str(workdir)]
        command += ["--peer-timeout-seconds", str(TEST_PEER_TIMEOUT_S)]  # `args` may override
        command += [*self.tokens.server_args(), *args]
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            command, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        self.port = self._wait_for_port()
        self.target = f"127.0.0.1:{self.port}"
        self.client = TrainerClient(self.target, auth=self.auth)
        self.channel = open_channel(self.target, self.auth)
        self.stub = trainer_pb2_grpc.TrainerServiceStub(self.channel)

    def _wait_for_port(self) -> int:
        while not self.port_file.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"trainer-svc exited early:\n{self.log_tail()}")
            time.sleep(0.2)
        return int(self.port_file.read_text())

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def export(self, name: str) -> dict[str, np.ndarray]:
        """The weights bit for bit as the trainer holds them, by HF name."""
        path = self.workdir / "exports" / name
        self.client.export_hf(path, dtype=ExportDType.PARAMS)
        return {k: v.numpy() for k, v in load_hf_state_dict(path).items()}

    def kill(self) -> None:
        """SIGKILL the launcher and every rank at once, as a node failure would, and reap the
        launcher."""
        kill_tree(psutil.Process(self.process.pid))
        self.process.wait()
        self.client.close()
        self.channel.close()
        self._log.close()

    def stop(self) -> int:
        self.client.close()
        self.channel.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self._log.close()
        return code


def rank_process(launcher: psutil.Process, rank: int) -> psutil.Process:
    """A local launcher's rank, by the name every rank gives itself (``trainer-rank<N>``): a
    forked rank's /proc environ is its launcher's."""
    (found,) = [p for p in launcher.children() if p.name() == f"trainer-rank{rank}"]
    return found


def kill_tree(process: psutil.Process) -> None:
    """SIGKILL `process` and all its descendants."""
    for proc in [*process.children(recursive=True), process]:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


def start_trainers(worlds: Mapping[str, tuple[Path, Sequence[str]]]) -> dict[str, TrainerProcess]:
    """Starts a world per entry (name -> (workdir, args)) at once and waits for all of them.
    Their start-ups overlap: while one world's launcher imports on one core, another's ranks
    use the other. If any fails to start, the others are stopped and its error is raised."""
    with ThreadPoolExecutor(max_workers=max(1, len(worlds))) as pool:
        futures = {
            name: pool.submit(TrainerProcess, workdir, args)
            for name, (workdir, args) in worlds.items()
        }
    started: dict[str, TrainerProcess] = {}
    errors: list[BaseException] = []
    for name, future in futures.items():
        error = future.exception()
        if error is None:
            started[name] = future.result()
        else:
            errors.append(error)
    if errors:
        stop_trainers(started.values())
        raise errors[0]
    return started


def stop_trainers(processes: Iterable[TrainerProcess]) -> list[int]:
    """Stops the worlds at once (each takes seconds to shut down); their exit codes, in order."""
    processes = list(processes)
    with ThreadPoolExecutor(max_workers=max(1, len(processes))) as pool:
        return list(pool.map(TrainerProcess.stop, processes))


def max_relative_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """Largest per-tensor max|a - b| / max|b| over the state dicts (which must share names)."""
    assert a.keys() == b.keys()
    worst = 0.0
    for name, tensor in a.items():
        scale = float(np.abs(b[name]).max()) or 1.0
        worst = max(worst, float(np.abs(tensor - b[name]).max()) / scale)
    return worst


def assert_bit_identical(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert np.array_equal(tensor, b[name]), f"{name} differs"
