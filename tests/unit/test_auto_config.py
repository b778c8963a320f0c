"""Auto-refit settings (the ``auto`` entry of the refit section) and the follower's choice of
the next version; the follower itself runs against a real vllm serve in
tests/inference/test_auto_refit.py."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from typing import Any

import pytest

from inference_ext.auto_config import AutoRefitConfig, FollowPolicy, PauseMode
from inference_ext.auto_refit import AutoRefit, choose_version
from inference_ext.refit_options import ReceiverAuth, RefitOptions
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
    target = RefitTarget(
        sidecar="127.0.0.1:1", options=RefitOptions(auth=ReceiverAuth(insecure=True))
    )
    follower = AutoRefit(None, target, AutoRefitConfig(retry_interval_s=1.0))  # type: ignore[arg-type]
    assert follower._retry_at(3) is None
    waits = []
    for _ in range(8):
        follower._fail(3, "the source is gone")
        at, _count = follower._failed[3]
        retry = follower._retry_at(3)
        assert retry is not None
        waits.append(retry - at)
    # Times on the monotonic clock: a large one leaves the differences a few ulps off.
    assert waits == pytest.approx([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0])
    assert follower._recently_failed(3) and not follower._recently_failed(4)
    assert follower.last_error == "version 3: the source is gone"


class RecordingEngine:
    """Pins down the order of the follower's engine calls; the real engine client runs in
    tests/inference/test_auto_refit.py."""

    def __init__(self, prefetch: list[str], refit_ok: bool = True) -> None:
        self.calls: list[tuple[str, object]] = []
        self._prefetch = prefetch  # each poll's state on both workers
        self._refit_ok = refit_ok

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append((method, args))
        if method in ("refit_prefetch", "refit_prefetch_state"):
            state = self._prefetch.pop(0)
            return [{"tp_rank": r, "version": args[0], "state": state} for r in (0, 1)]
        if method == "refit_to":
            error = None if self._refit_ok else "no"
            return [{"ok": self._refit_ok, "error": error, "expected": True}] * 2
        if method == "refit_expect":
            return [{"tp_rank": r, "version": args[0], "asking": True} for r in (0, 1)]
        raise AssertionError(method)

    async def pause_generation(self, *, mode, clear_cache):
        self.calls.append(("pause", (mode, clear_cache)))

    async def resume_generation(self) -> None:
        self.calls.append(("resume", ()))

    async def update_weight_version(self, new_version: str) -> None:
        self.calls.append(("weight_version", (new_version,)))

    async def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.calls.append(("reset_prefix_cache", (reset_running_requests,)))
        return True


def _follower(
    engine: RecordingEngine, mode: PauseMode, options: RefitOptions | None = None
) -> AutoRefit:
    target = RefitTarget(
        sidecar="127.0.0.1:1", options=options or RefitOptions(auth=ReceiverAuth(insecure=True))
    )
    config = AutoRefitConfig(pause_mode=mode, poll_interval_s=0.001)
    return AutoRefit(engine, target, config)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", list(PauseMode))
def test_a_switch_pauses_installs_labels_and_resumes(mode: PauseMode) -> None:
    engine = RecordingEngine(["pending", "pending", "ready"])
    follower = _follower(engine, mode)
    asyncio.run(follower._refit(7))
    names = [c[0] for c in engine.calls]
    expected = ["refit_prefetch", "refit_prefetch_state", "refit_prefetch_state", "pause"]
    expected += ["refit_to", "weight_version"]
    expected += ["reset_prefix_cache"] if mode is PauseMode.KEEP else []
    assert names == [*expected, "resume"]
    # keep: the KV cache is recomputed after the install; wait/abort clear it at the pause.
    assert engine.calls[3] == ("pause", (mode.value, mode is not PauseMode.KEEP))
    assert ("weight_version", ("7",)) in engine.calls
    assert follower.installed == 7 and follower.last_error is None
    assert [s.version for s in follower.switches] == [7]


_ENGINE_CALLS = (
    "collective_rpc",
    "pause_generation",
    "resume_generation",
    "update_weight_version",
    "reset_prefix_cache",
)


def test_the_status_never_shows_an_installed_version_without_its_switch() -> None:
    """Whatever the engine is asked, a status read meanwhile (the server answers between any
    two awaits) names an installed version only together with its switch."""
    seen: list[tuple[int | None, list[int]]] = []

    class Watching(RecordingEngine):
        def __getattribute__(self, name: str) -> Any:
            if name in _ENGINE_CALLS:
                seen.append((follower.installed, [s.version for s in follower.switches]))
            return super().__getattribute__(name)

    engine = Watching(["ready", "ready"])
    follower = _follower(engine, PauseMode.KEEP)
    asyncio.run(follower._refit(7))
    asyncio.run(follower._refit(8))
    seen.append((follower.installed, [s.version for s in follower.switches]))
    assert seen[-1] == (8, [7, 8])
    for installed, switches in seen:
        assert installed == (switches[-1] if switches else None), seen


@pytest.mark.parametrize("newest", [7, 9])
def test_a_follower_keeping_up_asks_ahead_for_the_next_version(newest: int) -> None:
    """After switching to the newest version the workers ask the sidecar for the next one
    (refit_expect), once generation has resumed; a follower that is behind does not."""
    engine = RecordingEngine(["ready"])
    follower = _follower(engine, PauseMode.KEEP)
    follower.newest = newest
    asyncio.run(follower._refit(7))
    names = [c[0] for c in engine.calls]
    if newest == 7:
        assert engine.calls[-1] == ("refit_expect", (8,))
        assert names.index("refit_expect") > names.index("resume")
        assert follower.status()["asked_ahead"] == 8
        follower.newest = 8  # announced: the ask is answered, none stands
        assert follower.status()["asked_ahead"] is None
    else:
        assert "refit_expect" not in names
        assert follower.status()["asked_ahead"] is None
    assert follower.switches[-1].expected  # the workers' refit_to said so


def test_asked_ahead_names_only_an_ask_every_worker_took() -> None:
    """A worker busy pulling does not ask (``asking: False``); a failed call asks nothing:
    the status then names no version asked ahead."""

    class Busy(RecordingEngine):
        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            if method == "refit_expect":
                self.calls.append((method, args))
                return [{"tp_rank": 0, "asking": True}, {"tp_rank": 1, "asking": False}]
            return await super().collective_rpc(method, timeout, args, kwargs)

    class Failing(RecordingEngine):
        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            if method == "refit_expect":
                raise RuntimeError("the engine is gone")
            return await super().collective_rpc(method, timeout, args, kwargs)

    for engine in (Busy(["ready"]), Failing(["ready"])):
        follower = _follower(engine, PauseMode.KEEP)
        follower.newest = 7
        asyncio.run(follower._refit(7))
        assert follower.installed == 7 and follower.status()["asked_ahead"] is None


def test_a_failed_prefetch_never_pauses_generation() -> None:
    engine = RecordingEngine(["pending", "failed"])
    follower = _follower(engine, PauseMode.KEEP)
    asyncio.run(follower._refit(7))
    assert [c[0] for c in engine.calls] == ["refit_prefetch", "refit_prefetch_state"]
    assert follower.installed is None
    assert follower.last_error is not None and follower.last_error.startswith("version 7:")


def test_a_refused_install_resumes_on_the_old_version() -> None:
    engine = RecordingEngine(["ready"], refit_ok=False)
    follower = _follower(engine, PauseMode.WAIT)
    asyncio.run(follower._refit(7))
    assert [c[0] for c in engine.calls] == ["refit_prefetch", "pause", "refit_to", "resume"]
    assert follower.installed is None and follower.switches == collections.deque()


@pytest.mark.parametrize("keeping_up", [True, False])
def test_a_follower_keeping_up_asks_again_before_its_ask_lapses(keeping_up: bool) -> None:
    """A training step may outlast the sidecar's wait for the version asked ahead (one
    visible_timeout_s): while nothing newer is announced, the follower asks for the next
    version again every half of that wait; one that is behind does not."""
    engine = RecordingEngine(["ready"])
    options = RefitOptions(auth=ReceiverAuth(insecure=True), visible_timeout_s=0.2)
    follower = _follower(engine, PauseMode.KEEP, options)
    follower.newest = 7

    async def follow_for(seconds: float) -> None:
        await follower._refit(7)
        if not keeping_up:
            follower.newest = 9
            follower._failed[9] = (time.monotonic() + 60, 1)  # not tried meanwhile
        task = asyncio.create_task(follower._follow())
        await asyncio.sleep(seconds)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(follow_for(1.0))
    asks = [args for name, args in engine.calls if name == "refit_expect"]
    if keeping_up:
        assert asks[0] == (8,) and len(asks) >= 4, asks  # at 0, 0.1, 0.2, ... s
        assert set(asks) == {(8,)}
    else:
        assert asks == [(8,)]  # the one after the switch, when it kept up
