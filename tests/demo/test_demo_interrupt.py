"""Ctrl-C in the middle of the demo stops every process it started: the trainer's ranks, the
sidecar and an engine's core and workers. Its own module, so the default run can give it a
worker apart from the shortened run's."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tests.demo.demo_process import VERSION_LINE, start, wait_gone


def test_ctrl_c_mid_run_stops_every_process(tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    # One engine (TP=2: an engine core and two worker processes to clean up) and a short
    # warm-up: the run is interrupted at its first GRPO version anyway. With --verbose, vLLM's
    # logs share the terminal.
    process, log_path = start(
        workdir, "--iterations", "50", "--engine-tp", "2", "--warmup-steps", "5", "--verbose"
    )
    deadline = time.monotonic() + 1200
    while not VERSION_LINE.search(log_path.read_text()):
        assert process.poll() is None, log_path.read_text()[-4000:]
        assert time.monotonic() < deadline, "no GRPO version line in time"
        time.sleep(1)
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    assert process.wait(timeout=300) == 130, log_path.read_text()[-4000:]
    assert wait_gone(process, workdir) == []
    output = log_path.read_text()
    assert "vLLM logs: on this terminal (--verbose)" in output
    assert "(EngineCore pid=" in output
    assert not (workdir / "vllm.log").exists()
    assert "interrupted: every process was stopped" in output
