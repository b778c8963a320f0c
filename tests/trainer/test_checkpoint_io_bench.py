"""`benchmarks.checkpoint_io` end to end on the CPU (tiny preset, TP=2): the checkpoint it writes
is split in files with an index, every rank reports its load and its part of the export, and each
rank read exactly its share."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_checkpoint_benchmark_reports_every_ranks_load_and_export(tmp_path: Path) -> None:
    out, work = tmp_path / "io.json", tmp_path / "work"
    command = [sys.executable, "-m", "benchmarks.checkpoint_io", "--preset", "tiny", "--tp", "2"]
    command += ["--files", "3", "--export-file-bytes", "200000", "--params-dtype", "float32"]
    command += ["--work-dir", str(work), "--out", str(out)]
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    index = json.loads((work / "model" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    assert result["checkpoint"]["bytes"] == index["metadata"]["total_size"]
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    for rank in result["ranks"]:
        assert rank["read_over_share"] == 1.0
        assert rank["share"] > 0 and rank["peak"] >= 0 and rank["export_peak"] >= 0
    assert result["export"]["bytes"] == result["checkpoint"]["bytes"]  # bf16 both
    assert result["export"]["files"] >= 3 and result["export"]["index"]
    assert result["export"]["bit_exact"]  # bf16 through float32 parameters and back
    assert result["export"]["seconds"] > 0 and result["export"]["disk_seconds"] > 0
    assert result["meta"]["command"].endswith(" ".join(command[3:]))
    assert "export:" in done.stdout and "time to SERVING" in done.stdout
