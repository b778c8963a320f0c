"""`examples.console.routed_output`: the demo's own lines reach the terminal; whatever else its
process and the processes it starts print goes to the log; an exception's traceback, raised
inside the block, still reaches the terminal. Each case runs in a child Python whose stdout and
stderr stand in for the terminal, since the routing rewires file descriptors 1 and 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import logging, subprocess, sys
from pathlib import Path
from examples.console import routed_output

log = Path(sys.argv[1]) if sys.argv[1] != "-" else None
with routed_output(log) as console:
    print("library print")
    logging.getLogger("library").warning("library warning")
    subprocess.run([sys.executable, "-c", "import sys; print('child out');"
                    "print('child err', file=sys.stderr)"], check=True)
    console.line("result line")
    for _ in console.progress(range(3), desc="a bar"):
        pass
    console.error("failure line")
    if sys.argv[2] == "raise":
        raise RuntimeError("the run failed")
print("after the block")
"""

LIBRARY = ("library print", "library warning", "child out", "child err")


def _run(log: str, then: str = "return") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, log, then],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
    )


def test_library_and_child_output_go_to_the_log_the_demo_lines_to_the_terminal(
    tmp_path: Path,
) -> None:
    log = tmp_path / "vllm.log"
    result = _run(str(log))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["result line", "after the block"]
    assert "a bar: 100%" in result.stderr
    assert "failure line" in result.stderr
    terminal = result.stdout + result.stderr
    assert [line for line in LIBRARY if line in terminal] == []
    logged = log.read_text()
    assert [line for line in LIBRARY if line not in logged] == []
    assert "result line" not in logged
    assert "a bar" not in logged


def test_a_traceback_from_inside_the_block_reaches_the_terminal(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    result = _run(str(log), then="raise")
    assert result.returncode == 1
    assert "RuntimeError: the run failed" in result.stderr
    assert "Traceback" not in log.read_text()


def test_without_a_log_everything_shares_the_terminal(tmp_path: Path) -> None:
    result = _run("-")
    assert result.returncode == 0, result.stderr
    terminal = result.stdout + result.stderr
    assert [
        line for line in (*LIBRARY, "result line", "failure line") if line not in terminal
    ] == []
