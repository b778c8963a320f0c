"""`benchmarks.refit_pull.interleaved`: a trainer publishing every third version, each
publishing step and the step after it against the two steps around them that publication does
not touch; the hold-up is the median of those differences, with a distribution-free interval."""

from __future__ import annotations

import random

import pytest

from benchmarks.refit_pull import EVERY, interleaved, median_interval


def _record(step: int, finish_s: float, before_finish_s: float) -> dict[str, object]:
    return dict(
        step=step,
        warmup=step == 0,
        seconds=before_finish_s + finish_s,
        finish_s=finish_s,
    )


def _role(step: int) -> str:
    """Step i makes version i + 1; multiples of EVERY publish."""
    return {0: "publishing", 1: "after"}.get((step + 1) % EVERY, "clean")


def test_the_hold_up_counts_the_publishing_step_and_the_step_after_it() -> None:
    # A publishing FinishTrainStep takes 3 ms longer; the step after it 0.5 ms longer before
    # its FinishTrainStep and 1 ms longer in it (the copy and the report beside its work). An
    # estimate taking the step after a publication as its baseline would miss the 1.5 ms.
    records = []
    for step in range(40):
        role = _role(step)
        finish = 0.100 + {"publishing": 0.003, "after": 0.001}.get(role, 0.0)
        work = 0.050 + (0.0005 if role == "after" else 0.0)
        records.append(_record(step, finish, work))
    result = interleaved(records)
    assert result["every"] == 3 and result["steps"] == 39
    assert result["periods"] == 12  # steps 2, 5, ..., 35; 38 has no clean step after it
    assert result["holdup_ms"] == pytest.approx(4.5)
    assert result["holdup_interval_ms"] == pytest.approx([4.5, 4.5])
    assert result["holdup_mean_ms"] == pytest.approx(4.5)
    assert result["publishing_ms"]["median"] == pytest.approx(3.0)
    assert result["after_ms"]["median"] == pytest.approx(1.5)
    assert result["before_finish_ms"]["mean"] == pytest.approx(0.5)
    assert result["finish_ms"]["mean"] == pytest.approx(4.0)
    medians = result["step_median_ms"]
    assert medians == pytest.approx(dict(publishing=153.0, after=151.5, clean=150.0))


def test_a_slow_drift_of_the_steps_cancels() -> None:
    # Every step 2 ms slower than the one before, and no publication cost.
    records = [_record(step, 0.100 + 0.002 * step, 0.050 + 0.002 * step) for step in range(41)]
    result = interleaved(records)
    assert result["holdup_ms"] == pytest.approx(0.0, abs=1e-9)
    assert result["holdup_standard_error_ms"] == pytest.approx(0.0, abs=1e-9)
    assert result["publishing_ms"]["median"] == pytest.approx(0.0, abs=1e-9)
    assert result["after_ms"]["median"] == pytest.approx(0.0, abs=1e-9)


def test_the_median_resists_the_long_tail_of_a_steps_time() -> None:
    # A hold-up of 1 ms, steps jittering by up to 2 ms, and one step in ten 60 ms late (the
    # tail the GPU hosts show): the mean moves with the tail, the median and its interval
    # stay with the hold-up.
    rng = random.Random(7)
    records = []
    for step in range(3001):
        late = 0.060 if rng.random() < 0.1 else 0.0
        cost = 0.001 if _role(step) == "publishing" else 0.0
        records.append(_record(step, 0.100 + cost + late + rng.uniform(0, 0.002), 0.003))
    result = interleaved(records)
    low, high = result["holdup_interval_ms"]
    assert low < 1.0 < high and high - low < 1.0
    assert result["holdup_ms"] == pytest.approx(1.0, abs=0.4)
    assert result["holdup_standard_error_ms"] > 3 * (high - low) / 4


def test_the_median_interval_takes_the_order_statistics_around_the_middle() -> None:
    assert median_interval([float(v) for v in range(100)]) == (40.0, 59.0)
    assert median_interval([5.0]) == (5.0, 5.0)
    assert median_interval([2.0, 1.0, 3.0]) == (1.0, 3.0)
