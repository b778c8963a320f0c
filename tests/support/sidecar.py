"""Starts a real refit-sidecar process (gRPC on port 0) for tests and stops it cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def start_sidecar(workdir: Path, *args: str, port: int = 0) -> tuple[subprocess.Popen, str]:
    """A refit-sidecar process on `port` (0: a free one) and its HOST:PORT, once it serves."""
    workdir.mkdir(parents=True, exist_ok=True)
    port_file = workdir / "sidecar-port"
    port_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "refit_sidecar", "--port", str(port), "--host", "127.0.0.1"]
    process = subprocess.Popen([*command, "--port-file", str(port_file), *args], env=os.environ)
    while not port_file.exists():
        assert process.poll() is None, "refit-sidecar exited early"
        time.sleep(0.05)
    return process, f"127.0.0.1:{port_file.read_text()}"


@contextmanager
def running_sidecar(workdir: Path, *args: str) -> Iterator[str]:
    """Yields the sidecar's HOST:PORT; asserts a clean exit on SIGTERM afterwards."""
    process, address = start_sidecar(workdir, *args)
    try:
        yield address
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
