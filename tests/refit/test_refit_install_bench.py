"""`benchmarks/refit_install.py` end to end on the CPU with a bfloat16 trainer: the receiver
reads each version behind the trainer's snapshot copy straight into a transformers model's
tensors (in place), casts the norms the trainer keeps in float32 into the model's bfloat16
ones from one arena, and the installed model must equal ExportHF bit for bit and compute the
trainer's Forward logprobs (the benchmark's own check, on the last version)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_an_in_place_refit_with_cast_norms_equals_export_and_forward(tmp_path: Path) -> None:
    out, logs = tmp_path / "install.json", tmp_path / "logs"
    command = [sys.executable, "-m", "benchmarks.refit_install", "--preset", "tiny"]
    command += ["--device", "cpu", "--params-dtype", "bfloat16", "--steps", "2", "--trace"]
    command += ["--out", str(out), "--log-dir", str(logs), "--work-dir", str(tmp_path / "work")]
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    check = result["check"]
    assert check["identical"] and not check["differing"] and not check["not_exported"], check
    assert check["cast_to_model_dtype"] > 0  # the fp32 norms, cast into bf16 tensors
    assert check["max_logprob_gap"] < 0.02, check  # bf16 against the trainer's Forward
    timed = [r["refit"]["stats"] for r in result["records"] if not r["warmup"]]
    assert len(timed) == 2
    for stats in timed:
        assert stats["in_place_bytes"] > 0, stats
        assert stats["lease_held_by"] == "checksums", stats  # every read verified
        # --trace: the pull's timeline, from its start to its check's end, in time order.
        # Behind the copy, the gate opened on its first look (in the trace and the stats) or,
        # when the sidecar's answer came first, on its word that the version is readable
        # (that may be while the early pull was planned, before it began).
        events = [name for _, name, _, _ in stats["trace"]]
        pulled = [name for name in events if name != "readable"]
        assert pulled[0] == "began" and pulled[-1] == "verified", events
        assert {"prepared", "posted", "landed"} <= set(events), events
        times = [at for at, *_ in stats["trace"]]
        assert times == sorted(times)
        if "saw" in events:
            assert stats["gate_rounds"] >= 1 and 0 < stats["gate_first_s"] < stats["pull_s"]
        else:
            assert "readable" in events and stats["gate_rounds"] == 0, (events, stats)
    traced = set(result["summary"]["trace_ms"])
    assert {"prepared", "posted", "landed", "verified"} <= traced
    assert traced & {"saw", "readable"}, traced
    assert traced <= {"prepared", "saw", "readable", "posted", "landed", "verified"}, traced
    # Every cast tensor lives in the one arena its fp32 slices' span maps to.
    adopted = re.findall(
        r"(\d+) cast in, (\d+) of them from (\d+) arenas", (logs / "receiver.log").read_text()
    )
    assert adopted and all(int(n) > 0 and n == m and k == "1" for n, m, k in adopted), adopted
