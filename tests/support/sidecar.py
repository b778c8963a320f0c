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


@contextmanager
def running_sidecar(workdir: Path, *args: str) -> Iterator[str]:
    """Yields the sidecar's HOST:PORT; asserts a clean exit on SIGTERM afterwards."""
    workdir.mkdir(parents=True, exist_ok=True)
    port_file = workdir / "sidecar-port"
    command = [sys.executable, "-m", "refit_sidecar", "--port", "0", "--host", "127.0.0.1"]
    process = subprocess.Popen([*command, "--port-file", str(port_file), *args], env=os.environ)
    try:
        while not port_file.exists():
            assert process.poll() is None, "refit-sidecar exited early"
            time.sleep(0.05)
        yield f"127.0.0.1:{port_file.read_text()}"
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
