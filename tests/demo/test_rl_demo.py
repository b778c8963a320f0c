"""The main job, shortened: `python -m examples.rl_loop` brings up the whole stack (trainer
TP=2, sidecar, vLLM engines TP=1 and TP=2), learns, keeps every engine within 1e-4 of the
trainer, and leaves no process behind, also when interrupted with Ctrl-C in the middle."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.support.trainer import TEST_ENV

SHORT_RUN = ["--iterations", "24"]
# The short run trains the tied-embedding variant; the fidelity tests cover untied models too.
TIED = ["--tie-embeddings"]
SUMMARY_LINE = re.compile(r"reward ([0-9.]+) -> ([0-9.]+) .* largest fidelity gap ([0-9.e+-]+)")
VERSION_LINE = re.compile(r"^v(\d+)\s+reward ([0-9.]+) .* gap ([0-9.e+-]+)$", re.MULTILINE)


def _start(workdir: Path, *args: str) -> tuple[subprocess.Popen[str], Path]:
    log_path = workdir.parent / "demo.log"
    command = [sys.executable, "-m", "examples.rl_loop", "--workdir", str(workdir), *args]
    process = subprocess.Popen(
        command,
        stdout=log_path.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **TEST_ENV, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,  # its own process group, as a terminal would give it
        text=True,
    )
    return process, log_path


def _leftovers(process: subprocess.Popen[str], workdir: Path) -> list[str]:
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


def _wait_gone(process: subprocess.Popen[str], workdir: Path) -> list[str]:
    deadline = time.monotonic() + 30
    while (left := _leftovers(process, workdir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def test_short_demo_learns_keeps_fidelity_and_cleans_up(tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    process, log_path = _start(workdir, *SHORT_RUN, *TIED)
    assert process.wait(timeout=1500) == 0, log_path.read_text()[-4000:]
    output = log_path.read_text()
    versions = VERSION_LINE.findall(output)
    assert len(versions) >= 4, output[-4000:]
    assert all(float(gap) <= 1e-4 for _, _, gap in versions)
    summary = SUMMARY_LINE.search(output)
    assert summary is not None, output[-2000:]
    assert float(summary[2]) >= float(summary[1]) + 0.05
    assert float(summary[3]) <= 1e-4
    assert _wait_gone(process, workdir) == []


def test_ctrl_c_mid_run_stops_every_process(tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    # One engine (TP=2: an engine core and two worker processes to clean up) and a short
    # warm-up: the run is interrupted at its first GRPO version anyway.
    process, log_path = _start(
        workdir, "--iterations", "50", "--engine-tp", "2", "--warmup-steps", "5"
    )
    deadline = time.monotonic() + 1200
    while not VERSION_LINE.search(log_path.read_text()):
        assert process.poll() is None, log_path.read_text()[-4000:]
        assert time.monotonic() < deadline, "no GRPO version line in time"
        time.sleep(1)
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    assert process.wait(timeout=300) == 130, log_path.read_text()[-4000:]
    assert _wait_gone(process, workdir) == []
