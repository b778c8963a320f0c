"""Starting the demo as a terminal would, and finding what it left running."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.support.trainer import TEST_ENV, TEST_PEER_TIMEOUT_S

VERSION_LINE = re.compile(r"^v(\d+)\s+reward ([0-9.]+) .* gap ([0-9.e+-]+)$", re.MULTILINE)
"""A GRPO iteration's line: its version, reward and fidelity gap."""


def start(workdir: Path, *args: str) -> tuple[subprocess.Popen[str], Path]:
    """`python -m examples.rl_loop` in its own session, its terminal written to ``demo.log``
    beside `workdir`."""
    log_path = workdir.parent / "demo.log"
    command = [sys.executable, "-m", "examples.rl_loop", "--workdir", str(workdir)]
    command += ["--peer-timeout-seconds", str(TEST_PEER_TIMEOUT_S), *args]
    process = subprocess.Popen(
        command,
        stdout=log_path.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **TEST_ENV, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,  # its own process group, as a terminal would give it
        text=True,
    )
    return process, log_path


def leftovers(process: subprocess.Popen[str], workdir: Path) -> list[str]:
    """Processes of the demo's session, or any process started for its work directory."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            in_session = os.getsid(proc.pid) == process.pid
        except ProcessLookupError:
            continue
        cmdline = " ".join(proc.info["cmdline"] or [])
        if in_session or str(workdir) in cmdline:
            found.append(f"{proc.pid}: {cmdline[:120]}")
    return found


def wait_gone(process: subprocess.Popen[str], workdir: Path) -> list[str]:
    """The demo's processes still running after up to 60 s: on two cores that the other test
    worker's stack keeps busy, the last ones (multiprocessing's resource tracker among them)
    may take that long to exit."""
    deadline = time.monotonic() + 60
    while (left := leftovers(process, workdir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left
