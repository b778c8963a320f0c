"""`python -m examples.async_rl_loop` at its defaults: the synchronous schedule and one with
generation one version ahead, each from the same warm-up checkpoint, against one `vllm serve`
replica that follows the trainer by auto-refit. Both learn; the asynchronous one trains on
tokens one version behind (the staleness histogram of each step says so) within its bound,
the synchronous one on tokens of the step's own version only."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.trainer import TEST_ENV, TEST_PEER_TIMEOUT_S

STEP = re.compile(r"^lag (\d) step +\d+ +v\d+ +reward [0-9.]+ +sequences by versions behind (.*)$")
SUMMARY = re.compile(
    r"^lag (\d): (\d+) trained tokens/s \((\d+) tokens in [0-9.]+ s; .*\), "
    r"reward ([0-9.]+) -> ([0-9.]+)$"
)


def test_both_schedules_learn_and_the_async_one_trains_one_version_behind(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "examples.async_rl_loop", "--workdir", str(tmp_path)]
    command += ["--peer-timeout-seconds", str(TEST_PEER_TIMEOUT_S)]
    command += ["--out", str(tmp_path / "figures.json")]
    run = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env={**os.environ, **TEST_ENV},
        timeout=1200,
        check=False,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    behind: dict[int, set[int]] = {0: set(), 1: set()}
    for lag, histogram in (m.groups() for m in map(STEP.match, run.stdout.splitlines()) if m):
        behind[int(lag)] |= {int(pair.split(":")[0]) for pair in histogram.split()}
    assert behind[0] == {0}, behind
    assert 1 in behind[1] and max(behind[1]) <= 1, behind
    summaries = {int(m[1]): m for m in map(SUMMARY.match, run.stdout.splitlines()) if m}
    assert set(summaries) == {0, 1}, run.stdout[-2000:]
    for lag, summary in summaries.items():
        first, last = float(summary[4]), float(summary[5])
        assert last >= first + 0.05, (lag, first, last)
        assert int(summary[2]) > 0 and int(summary[3]) > 0
    assert re.search(r"^lag 1 over lag 0: [0-9.]+x trained tokens/s$", run.stdout, re.MULTILINE)
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert "examples.async_rl_loop" in figures["meta"]["command"]
    by_lag = {s["lag"]: s for s in figures["schedules"]}
    for lag, summary in summaries.items():
        assert by_lag[lag]["tokens"] == int(summary[3])
        assert len(by_lag[lag]["rewards"]) == 24
