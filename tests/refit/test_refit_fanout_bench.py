"""`benchmarks.refit_fanout` end to end on the CPU (tiny model, two receivers, one child per
source): every mode is timed, the tree is a chain, and each refit reports the sidecar's times
beside its own, which the sidecar's DEBUG log repeats, and with `--trace` its pull's timeline
(what each level of the chain adds)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import refit_install as ri
from benchmarks.refit_fanout import _paired, placement

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_fanout_benchmark_reports_when_the_sidecar_answered_each_receiver(
    tmp_path: Path,
) -> None:
    out, logs = tmp_path / "fanout.json", tmp_path / "logs"
    command = [sys.executable, "-m", "benchmarks.refit_fanout", "--preset", "tiny"]
    command += ["--device", "cpu", "--receivers", "2", "--max-children", "1", "--rounds", "3"]
    command += ["--no-verify", "--sidecar-log-level", "DEBUG", "--trace"]
    command += ["--out", str(out), "--log-dir", str(logs), "--work-dir", str(tmp_path / "work")]
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert set(result["summary"]["median_ms"]) == {"one", "one-tree", "star", "tree"}
    assert result["meta"]["gpus"] == ri.gpus()  # the cards measured on (none here)
    assert set(result["summary"]["paired_over_one"]) == {"one", "one-tree", "star", "tree"}
    trees = [r for r in result["records"] if r["mode"] == "tree"]
    assert trees
    for record in trees:
        sources = sorted(sorted(x["stats"]["bytes_by_source"]) for x in record["refits"])
        assert sources[0][0].startswith("fanout-") and sources[1][0].startswith("trainer-rank")
        for refit in record["refits"]:
            s = refit["stats"]
            # One host, one clock: readable, answered, in the receiver's hand, first read.
            assert 0 < s["sidecar_readable_at"] <= s["sidecar_answered_at"] <= s["leased_at"], s
            assert s["leased_at"] <= s["pull_started"] <= s["pull_finished"], s
            # The step's wall-clock return, against which each round's timeline is printed.
            assert s["leased_at"] - 5 < record["step"]["finished_wall"] < s["pull_finished"], s
        assert f"version {record['step']['version']}: per receiver, ms after" in done.stderr
        # The pulls' timelines: the child saw its parent's fills grow to the last one, no
        # sooner than the parent began storing it.
        child, parent = sorted(record["refits"], key=_reads_a_peer, reverse=True)
        events = {name for _, name, _, _ in child["stats"]["trace"]}
        assert {"posted", "landed", "saw", "filled"} <= events, events
        stored = max(
            (value, at) for at, name, _, value in parent["stats"]["trace"] if name == "filled"
        )
        seen = [(at, value) for at, name, peer, value in child["stats"]["trace"] if name == "saw"]
        assert all(
            peer == parent["agent"] for _, name, peer, _ in child["stats"]["trace"] if name == "saw"
        )
        assert max(seen, key=lambda s: s[1])[1] == stored[0]
        assert min(at for at, value in seen if value == stored[0]) >= stored[1]
        assert f"version {record['step']['version']}: traced, " in done.stderr
    # A tree that keeps its shape repeats each receiver's answer: the sidecar names only its
    # key, and the receiver replays the plan it holds.
    assert all(x["stats"]["routes_left_out"] for x in trees[-1]["refits"]), trees[-1]["refits"]
    # (The first tree round's child met its parent's copy for the first time: a whole answer.)
    assert not all(x["stats"]["routes_left_out"] for x in trees[0]["refits"])
    log = (logs / "sidecar.log").read_text()
    last = trees[-1]["step"]["version"]
    assert f"version {last} readable at" in log
    assert log.count(f"version {last}: sources for ") == 2


def _reads_a_peer(refit: dict[str, Any]) -> bool:
    return any(s.startswith("fanout-") for s in refit["stats"]["bytes_by_source"])


def test_each_mode_is_also_compared_with_the_direct_receiver_of_its_own_round() -> None:
    timed = [
        {"round": 0, "mode": "one", "latency_s": 2.0},
        {"round": 0, "mode": "tree", "latency_s": 3.0},
        {"round": 1, "mode": "tree", "latency_s": 6.0},
        {"round": 1, "mode": "one", "latency_s": 4.0},
        {"round": 2, "mode": "tree", "latency_s": 8.0},  # its round's "one" was a warm-up
        {"round": 3, "mode": "one", "latency_s": 1.0},
        {"round": 3, "mode": "tree", "latency_s": 1.25},
    ]
    assert _paired(timed) == {"one": 1.0, "tree": 1.5}


def _placed(receivers: int, gpus: str | None, *, device: str = "cuda") -> list[int | None]:
    config = argparse.Namespace(cuda=device == "cuda", dest_gpu=1)
    return placement(config, argparse.Namespace(receivers=receivers, receiver_gpus=gpus))  # type: ignore[arg-type]


def test_receivers_are_placed_on_the_dest_gpu_or_one_gpu_each() -> None:
    assert _placed(3, None) == [1, 1, 1]
    assert _placed(3, "1,0,1") == [1, 0, 1]  # one beside the trainer
    assert _placed(2, "1,0", device="cpu") == [None, None]
    with pytest.raises(SystemExit, match="needs 3 GPU indices"):
        _placed(3, "1,0")
    with pytest.raises(SystemExit, match="receiver 0"):
        _placed(2, "0,1")  # the baseline would read the trainer's GPU locally
