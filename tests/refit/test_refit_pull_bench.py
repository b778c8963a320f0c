"""`benchmarks/refit_pull.py` end to end on the CPU: the pull against the copies, the two
trainer processes, and the trainer publishing every other version whose steps give the
publication's hold-up within one process."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_pull_benchmark_measures_the_hold_up_within_one_trainer(tmp_path: Path) -> None:
    out, logs = tmp_path / "pull.json", tmp_path / "logs"
    command = [sys.executable, "-m", "benchmarks.refit_pull", "--preset", "tiny"]
    command += ["--device", "cpu", "--alternating-steps", "8"]
    command += ["--out", str(out), "--log-dir", str(logs), "--work-dir", str(tmp_path / "work")]
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert summary["pulled_equals_export"] is True
    assert summary["max_loss_difference"] == 0  # the same steps with and without publication
    every_other = result["runs"]["alternating"]
    # A warm-up and 8 timed steps made versions 1..9; the sidecar saw the even ones only.
    assert every_other["weights_version"] == 9
    readable = dict(enumerate(every_other["readable_after_finish_ms"], start=1))
    assert all(readable[v] is None for v in (1, 3, 5, 7, 9)) and readable[8] is not None
    holdup = summary["alternating"]
    assert holdup["steps"] == 8 and holdup["pairs"] == 2  # steps 3 and 5, each between two
    assert math.isfinite(holdup["holdup_ms"]) and holdup["holdup_standard_error_ms"] > 0
    assert "publication's hold-up of the loop" in done.stdout
