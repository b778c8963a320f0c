"""`benchmarks/refit_pull.py` end to end on the CPU: the pull against the copies, the two
trainer processes, and the trainer publishing every third version whose steps give the
publication's hold-up within one process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_pull_benchmark_measures_the_hold_up_within_one_trainer(tmp_path: Path) -> None:
    out, logs = tmp_path / "pull.json", tmp_path / "logs"
    command = [sys.executable, "-m", "benchmarks.refit_pull", "--preset", "tiny"]
    command += ["--device", "cpu", "--interleaved-steps", "8"]
    command += ["--out", str(out), "--log-dir", str(logs), "--work-dir", str(tmp_path / "work")]
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert summary["pulled_equals_export"] is True
    assert summary["max_loss_difference"] == 0  # the same steps with and without publication
    third = result["runs"]["interleaved"]
    # Its steps are light: one microbatch of the preset's two sequences of 64 tokens (each
    # sequence's first token untrained), against two such microbatches in the other runs.
    assert {r["valid_tokens"] for r in third["records"]} == {2 * 63}
    assert {r["valid_tokens"] for r in result["runs"]["publish"]["records"]} == {2 * 2 * 63}
    # A warm-up and 8 timed steps made versions 1..9; the sidecar saw multiples of 3 only.
    assert third["weights_version"] == 9
    readable = dict(enumerate(third["readable_after_finish_ms"], start=1))
    assert all(readable[v] is None for v in (1, 2, 4, 5, 7, 8))
    assert readable[3] is not None and readable[6] is not None
    holdup = summary["interleaved"]
    assert holdup["steps"] == 8 and holdup["periods"] == 2  # steps 2 and 5, with 1..4 and 4..7
    low, high = holdup["holdup_interval_ms"]
    assert low <= holdup["holdup_ms"] <= high and holdup["holdup_standard_error_ms"] > 0
    assert "publication's hold-up of the loop" in done.stdout
