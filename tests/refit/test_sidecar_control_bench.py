"""`benchmarks.sidecar_control` on a real sidecar: receivers that asked ahead are answered once
each version is published, through a chain (one child per source) and directly, for dense and
mixture-of-experts manifests (experts one tensor each, or grouped per layer), and a vLLM
worker's own plan of the manifest where it can plan one."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.sidecar_control import Config, ExpertLayout, run


@pytest.mark.parametrize(
    ("direct", "experts", "layout", "tensors"),
    [
        (False, 0, ExpertLayout.PER_EXPERT, 2 * 6 + 3),
        (True, 0, ExpertLayout.PER_EXPERT, 2 * 6 + 3),
        (True, 4, ExpertLayout.PER_EXPERT, 2 * (4 + 1 + 2 * 4) + 3),
        (False, 4, ExpertLayout.GROUPED, 2 * (4 + 1 + 2) + 3),
    ],
)
def test_parked_receivers_are_answered_for_every_version(
    tmp_path: Path, direct: bool, experts: int, layout: ExpertLayout, tensors: int
) -> None:
    config = Config(
        layers=2,
        hidden=16,
        experts=experts,
        expert_layout=layout,
        receivers=2,
        max_children=1,
        direct=direct,
        slots=2,
        warmup=1,
        versions=2,
        timeout=60.0,
        out=None,
    )
    result = run(config, tmp_path)
    records = result["records"]
    assert [r["version"] for r in records] == [1, 2, 3]
    assert all(len(r["latencies_s"]) == 2 and min(r["latencies_s"]) > 0 for r in records)
    summary = result["summary"]
    assert summary["tensors"] == tensors
    keys = ("in_process_publication_s", "in_process_answer_s", "in_process_plan_s", "empty_call_s")
    for key in keys:
        assert 0 < summary[key] < 1, key
    assert summary["empty_call_cpu_s"] > 0 and summary["empty_call_after_idle_s"] > 0
    # A vLLM worker plans its own targets where the experts are published grouped (or none).
    worker_plans = experts == 0 or layout is ExpertLayout.GROUPED
    assert ("in_process_worker_plan_s" in summary) == worker_plans
    if worker_plans:
        assert 0 < summary["in_process_worker_plan_s"] < 1
    if direct:
        assert all(r["sources"] == [None, None] for r in records)
    else:
        # A chain: one receiver reads the trainer's rank, the other reads that receiver.
        for record in records:
            primaries = sorted(tuple(s) for s in record["sources"])
            assert primaries[0][0].startswith("receiver-"), record
            assert primaries[1] == ("trainer-rank0",), record
