"""`benchmarks.refit_pull.alternating`: a trainer publishing every other version, each
publishing step against its neighbours: its FinishTrainStep against theirs, and the work of
the step after it against the steps after them; the hold-up is the sum."""

from __future__ import annotations

import pytest

from benchmarks.refit_pull import alternating


def _record(step: int, finish_s: float, before_finish_s: float) -> dict[str, object]:
    return dict(
        step=step,
        warmup=step == 0,
        seconds=before_finish_s + finish_s,
        finish_s=finish_s,
    )


def test_the_hold_up_adds_the_publishing_finish_and_the_next_steps_work() -> None:
    # Step i makes version i + 1; versions 2, 4, 6... publish (steps 1, 3, 5...). A publishing
    # FinishTrainStep takes 3 ms longer, and the step after it 1 ms longer before its finish.
    records = []
    for step in range(9):
        publishes = (step + 1) % 2 == 0
        after_publication = step > 0 and step % 2 == 0
        finish = 0.100 + (0.003 if publishes else 0.0) + 0.0001 * (step % 3)
        work = 0.050 + (0.001 if after_publication else 0.0)
        records.append(_record(step, finish, work))
    result = alternating(records)
    assert result["steps"] == 8 and result["pairs"] == 2  # steps 3 and 5 (1 is beside warm-up)
    assert result["finish_ms"]["median"] == pytest.approx(3.0, abs=0.21)
    assert result["next_ms"]["median"] == pytest.approx(1.0, abs=1e-9)
    assert result["next_ms"]["standard_error"] == pytest.approx(0.0, abs=1e-9)
    assert result["holdup_ms"] == pytest.approx(4.0, abs=0.21)
    assert result["holdup_mean_ms"] == pytest.approx(4.0, abs=0.11)
    assert 0 < result["holdup_standard_error_ms"] < 0.2
    assert result["finish_median_ms"]["publishing"] > result["finish_median_ms"]["not"]
    assert result["next_median_ms"]["after"] == pytest.approx(51.0)
    assert result["next_median_ms"]["not_after"] == pytest.approx(50.0)


def test_a_slow_drift_of_the_steps_cancels_in_the_pairs() -> None:
    # Every step 2 ms slower than the one before, and no publication cost: against the mean
    # of its neighbours a step shows none.
    records = [_record(step, 0.100 + 0.002 * step, 0.050 + 0.002 * step) for step in range(41)]
    result = alternating(records)
    assert result["finish_ms"]["median"] == pytest.approx(0.0, abs=1e-9)
    assert result["next_ms"]["median"] == pytest.approx(0.0, abs=1e-9)
    assert result["holdup_ms"] == pytest.approx(0.0, abs=1e-9)
    assert result["holdup_standard_error_ms"] == pytest.approx(0.0, abs=1e-9)
