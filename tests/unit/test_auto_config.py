"""Auto-refit settings (the ``auto`` entry of the refit section) and the follower's choice of
the next version; the follower itself runs against a real vllm serve in
tests/inference/test_auto_refit.py."""

from __future__ import annotations

import pytest

from inference_ext.auto_config import AutoRefitConfig, FollowPolicy, PauseMode
from inference_ext.auto_refit import AutoRefit, choose_version
from inference_ext.receiver import RefitOptions
from inference_ext.worker_refit import RefitTarget


def test_auto_values() -> None:
    assert AutoRefitConfig.from_value(None) is None
    assert AutoRefitConfig.from_value(False) is None
    assert AutoRefitConfig.from_value(True) == AutoRefitConfig()
    config = AutoRefitConfig.from_value(
        {"policy": "every", "pause_mode": "wait", "max_staleness": 2}
    )
    assert config == AutoRefitConfig(
        policy=FollowPolicy.EVERY, pause_mode=PauseMode.WAIT, max_staleness=2
    )
    assert config is not None and AutoRefitConfig.from_value(config.to_dict()) == config


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("yes", 'refit "auto" must be true, false or an object'),
        ({"policy": "newest"}, "'newest' is not a valid FollowPolicy"),
        ({"pause_mode": "drain"}, "'drain' is not a valid PauseMode"),
        ({"max_staleness": -1}, "max_staleness must be an integer >= 0 or null, got -1"),
        ({"max_staleness": True}, "max_staleness must be an integer >= 0 or null"),
        ({"poll_interval_s": 0}, "poll_interval_s must be a positive number of seconds, got 0"),
        ({"retry_interval_s": float("nan")}, "retry_interval_s must be a positive number"),
        ({"follow": "latest"}, "unknown refit \"auto\" field(s) ['follow']"),
    ],
)
def test_bad_auto_values_are_refused(value: object, message: str) -> None:
    with pytest.raises(ValueError) as error:
        AutoRefitConfig.from_value(value)
    assert message in str(error.value)


def _never(version: int) -> bool:
    return False


LATEST = AutoRefitConfig()
EVERY = AutoRefitConfig(policy=FollowPolicy.EVERY)


@pytest.mark.parametrize(
    ("installed", "newest", "config", "expected"),
    [
        (None, None, LATEST, None),  # nothing published
        (None, 4, LATEST, 4),
        (None, 4, EVERY, 4),  # a fresh engine does not replay history
        (4, 4, LATEST, None),  # up to date
        (2, 5, LATEST, 5),
        (2, 5, EVERY, 3),
        (2, 5, AutoRefitConfig(policy=FollowPolicy.EVERY, max_staleness=2), 5),
        (2, 4, AutoRefitConfig(policy=FollowPolicy.EVERY, max_staleness=2), 3),
        (7, 2, EVERY, 2),  # the trainer started again: its numbers restarted
    ],
)
def test_choose_version(
    installed: int | None, newest: int | None, config: AutoRefitConfig, expected: int | None
) -> None:
    assert choose_version(installed, newest, config, _never) == expected


def test_recent_failures_are_skipped() -> None:
    failed = {3, 5}.__contains__
    assert choose_version(2, 5, EVERY, failed) == 4
    assert choose_version(2, 5, LATEST, failed) is None  # waits for a retry or a newer one
    assert choose_version(4, 5, EVERY, failed) is None


def test_a_version_that_keeps_failing_is_retried_less_and_less_often() -> None:
    target = RefitTarget(sidecar="127.0.0.1:1", options=RefitOptions(insecure=True))
    follower = AutoRefit(None, target, AutoRefitConfig(retry_interval_s=1.0))  # type: ignore[arg-type]
    assert follower._retry_at(3) is None
    waits = []
    for _ in range(8):
        follower._fail(3, "the source is gone")
        at, _count = follower._failed[3]
        retry = follower._retry_at(3)
        assert retry is not None
        waits.append(retry - at)
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert follower._recently_failed(3) and not follower._recently_failed(4)
    assert follower.last_error == "version 3: the source is gone"
