"""Auto-refit: a ``vllm serve`` replica follows the trainer by itself.

`AutoRefit` runs in the API server's event loop (started by the `endpoint_plugin`) and drives
the engine through vLLM's own engine client, as an orchestrator would through the RL routes:

1. a thread watches the sidecar (WatchVersions) and announces each newest readable version;
2. the follower picks the version to install (`FollowPolicy`, `AutoRefitConfig.max_staleness`)
   and has every worker prefetch it (``refit_prefetch``: the pull runs in a worker thread while
   the engine keeps generating), then polls ``refit_prefetch_state`` until every worker holds
   its bytes;
3. it switches at a scheduler step boundary: pause (`PauseMode`), ``refit_to`` (agree and
   install the staged bytes), set vLLM's weight version to the version number, drop the KV
   cache computed with the old weights, resume. The generation stall is the install.

Serving the newest version, the workers ask the sidecar for the next one ahead
(``refit_expect``), and ask again every half ``visible_timeout_s`` while nothing newer is
announced: an ask parked on the sidecar (the next version's slot not reserved yet) waits one
``visible_timeout_s``, and a training step may take longer.

A version whose prefetch or switch fails leaves every worker on the weights it serves; the
follower tries it again after ``retry_interval_s`` and a newer version at once. vLLM labels each
step's outputs with its weight version, so ``/inference/v1/generate`` reports for every
completion which versions produced which tokens (``weight_versions``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from inference_ext.auto_config import AutoRefitConfig, FollowPolicy, PauseMode
from inference_ext.worker_refit import RefitTarget
from refit_sidecar.service.client import SidecarClient

log = logging.getLogger(__name__)

_WATCH_RETRY_S = 1.0
"""How long the watch waits before reconnecting to a sidecar it lost."""
_SWITCHES_KEPT = 64
_FAILURES_KEPT = 64
_MAX_RETRY_S = 60.0
"""The longest wait before a failed version is tried again."""


class EngineControl(Protocol):
    """The part of vLLM's ``EngineClient`` (``AsyncLLM``) the follower drives."""

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any: ...

    async def pause_generation(self, *, mode: Any = ..., clear_cache: bool = ...) -> None: ...

    async def resume_generation(self) -> None: ...

    async def update_weight_version(self, new_version: str) -> None: ...

    async def reset_prefix_cache(
        self, reset_running_requests: bool = ..., reset_connector: bool = ...
    ) -> bool: ...


@dataclass(frozen=True)
class Switch:
    """One installed version: how long its prefetch ran beside generation, and how long
    generation stood still for the install."""

    version: int
    prefetch_s: float
    stall_s: float
    installed_at: float
    """Wall-clock time (``time.time()``) the engine resumed on it."""
    expected: bool = False
    """Every worker had asked for it before it was published (`Receiver.expect`)."""
    before_readable: bool = False
    """Every worker read it before it was readable, on the trainer's version words
    (`RefitStats.before_readable`)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "prefetch_s": round(self.prefetch_s, 6),
            "stall_s": round(self.stall_s, 6),
            "installed_at": self.installed_at,
            "expected": self.expected,
            "before_readable": self.before_readable,
        }


def choose_version(
    installed: int | None,
    newest: int | None,
    config: AutoRefitConfig,
    failed: Callable[[int], bool],
) -> int | None:
    """The version to install next, None for none. `failed(v)`: v failed recently and must
    not be tried yet. A newest version below the installed one comes from a trainer that
    started again (the sidecar's numbers restarted): it is installed like any other."""
    if newest is None or newest == installed:
        return None
    if installed is None or newest < installed or config.policy is FollowPolicy.LATEST:
        return None if failed(newest) else newest
    behind = newest - installed
    if config.max_staleness is not None and behind > config.max_staleness:
        return None if failed(newest) else newest
    for version in range(installed + 1, newest + 1):
        if not failed(version):
            return version
    return None


class AutoRefit:
    """Follows one sidecar for one engine; `start` in the engine's event loop."""

    def __init__(self, engine: EngineControl, target: RefitTarget, config: AutoRefitConfig) -> None:
        self.engine = engine
        self.target = target
        self.config = config
        self.installed: int | None = None
        """The version the engine serves (None: the weights it started with)."""
        self.newest: int | None = None
        """The newest readable version the sidecar announced."""
        self.last_error: str | None = None
        self.switches: collections.deque[Switch] = collections.deque(maxlen=_SWITCHES_KEPT)
        self._failed: dict[int, tuple[float, int]] = {}
        """Failed versions: when they failed last, and how many times."""
        self._asked: tuple[int, float] | None = None
        """The version the workers were last asked to ask for ahead, and when (monotonic)."""
        self._asking = False
        """Whether every worker took that ask (none was busy pulling, the call went through)."""
        self._changed = asyncio.Event()
        self._stopping = threading.Event()
        self._client: SidecarClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._watcher: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._watcher = threading.Thread(
            target=self._watch, args=(loop,), name="refit-watch", daemon=True
        )
        self._watcher.start()
        self._task = loop.create_task(self._follow(), name="refit-follow")
        log.info(
            "auto-refit: following %s (policy %s, pause %s, max staleness %s)",
            self.target.sidecar,
            self.config.policy.value,
            self.config.pause_mode.value,
            self.config.max_staleness,
        )

    async def stop(self) -> None:
        self._stopping.set()
        client = self._client
        if client is not None:
            client.close()  # ends the watch stream
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # -- what the routes report ------------------------------------------------------------

    def behind(self) -> int | None:
        """Versions the served one trails the newest announced (None: nothing announced, or
        the numbers restarted)."""
        if self.newest is None:
            return None
        if self.installed is None:
            return self.newest
        return max(self.newest - self.installed, 0)

    def readiness(self) -> tuple[bool, str]:
        """Whether the engine serves a trained version within the staleness limit, and why
        not."""
        if self.installed is None:
            return False, "no version is installed yet"
        limit = self.config.max_staleness
        behind = self.behind()
        if limit is not None and behind is not None and behind > limit:
            return False, (
                f"version {self.installed} trails the newest ({self.newest}) by {behind}, "
                f"more than max_staleness {limit}"
            )
        return True, f"serving version {self.installed}"

    def status(self) -> dict[str, Any]:
        ready, reason = self.readiness()
        return {
            "sidecar": self.target.sidecar,
            "installed_version": self.installed,
            "newest_version": self.newest,
            "ready": ready,
            "reason": reason,
            "last_error": self.last_error,
            "asked_ahead": self.asked_ahead(),
            "config": self.config.to_dict(),
            "switches": [s.to_dict() for s in self.switches],
        }

    def asked_ahead(self) -> int | None:
        """The next version every worker has asked the sidecar for, while the follower keeps
        up and nothing newer is announced; None otherwise."""
        if not self._asking or self._asked is None or self._ask_again_in() is None:
            return None
        return self._asked[0]

    # -- the watch thread --------------------------------------------------------------------

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        options = self.target.options
        lost = False
        while not self._stopping.is_set():
            try:
                self._client = SidecarClient(
                    self.target.sidecar, timeout=options.rpc_timeout_s, auth=options.client_auth()
                )
                for version in self._client.watch(0):
                    if lost:
                        log.info("auto-refit: the sidecar at %s answers again", self.target.sidecar)
                        lost = False
                    loop.call_soon_threadsafe(self._announce, version)
            except Exception as e:
                if self._stopping.is_set():
                    break
                if not lost:
                    log.warning(
                        "auto-refit: lost the sidecar at %s (%s); retrying every %.0f s",
                        self.target.sidecar,
                        e,
                        _WATCH_RETRY_S,
                    )
                    lost = True
            finally:
                if self._client is not None:
                    self._client.close()
            self._stopping.wait(_WATCH_RETRY_S)

    def _announce(self, version: int) -> None:
        """The sidecar's newest readable version; 0: none (a trainer registered again)."""
        self.newest = version or None
        self._changed.set()

    # -- the follower ------------------------------------------------------------------------

    def _retry_at(self, version: int) -> float | None:
        """When a failed version may be tried again: after `retry_interval_s`, doubling with
        each failure of it up to `_MAX_RETRY_S` (a dead trainer is not hammered)."""
        failure = self._failed.get(version)
        if failure is None:
            return None
        at, count = failure
        return at + min(self.config.retry_interval_s * 2 ** (count - 1), _MAX_RETRY_S)

    def _recently_failed(self, version: int) -> bool:
        retry = self._retry_at(version)
        return retry is not None and time.monotonic() < retry

    async def _follow(self) -> None:
        while True:
            version = choose_version(
                self.installed, self.newest, self.config, self._recently_failed
            )
            if version is None:
                self._changed.clear()
                waits = [w for w in (self._next_retry(), self._ask_again_in()) if w is not None]
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=min(waits, default=None))
                again = self._ask_again_in()
                if again is not None and again <= 0 and self._asked is not None:
                    await self._expect(self._asked[0])  # installed + 1, still not announced
                continue
            try:
                await self._refit(version)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the follower must outlive any one failure
                self._fail(version, f"{type(e).__name__}: {e}")

    def _ask_again_in(self) -> float | None:
        """Seconds until the workers' ask for the next version is renewed (due at 0 or
        less); None while the follower does not keep up or asked for nothing."""
        asked = self._asked
        if asked is None or self.installed is None or self.newest != self.installed:
            return None
        version, at = asked
        every = self.target.options.visible_timeout_s / 2
        if version != self.installed + 1 or every <= 0:
            return None
        return at + every - time.monotonic()

    def _next_retry(self) -> float | None:
        """Seconds until the earliest failed version may be tried again (None: none)."""
        now = time.monotonic()
        waits = [retry - now for v in self._failed if (retry := self._retry_at(v)) is not None]
        pending = [w for w in waits if w > 0]
        return min(pending) if pending else None

    def _fail(self, version: int, error: str) -> None:
        count = self._failed.get(version, (0.0, 0))[1] + 1
        self._failed[version] = (time.monotonic(), count)
        while len(self._failed) > _FAILURES_KEPT:
            del self._failed[min(self._failed, key=lambda v: self._failed[v][0])]
        served = "its initial weights" if self.installed is None else f"version {self.installed}"
        self.last_error = f"version {version}: {error}"
        log.warning("auto-refit: version %d not installed, serving %s: %s", version, served, error)

    async def _refit(self, version: int) -> None:
        begin = time.perf_counter()
        states = await self.engine.collective_rpc("refit_prefetch", args=(version,))
        while True:
            failed = [s for s in states if s["state"] in ("failed", "none")]
            if failed:
                worker = failed[0]
                self._fail(
                    version,
                    f"prefetch on worker tp {worker['tp_rank']}: "
                    f"{worker.get('error', 'the worker holds no prefetch of it')}",
                )
                return
            if all(s["state"] == "ready" for s in states):
                break
            await asyncio.sleep(self.config.poll_interval_s)
            states = await self.engine.collective_rpc("refit_prefetch_state", args=(version,))
        prefetch_s = time.perf_counter() - begin
        await self._switch(version, prefetch_s)

    async def _expect(self, version: int) -> None:
        """Keeping up with the trainer: every worker asks the sidecar for the next version
        now, so it is leased (through the tree, with its sources) the moment it is published.
        A follower that is behind skips this (it fetches a version that is readable already,
        and an expected one it then skipped would be answered for nothing)."""
        asking = False
        try:
            replies = await self.engine.collective_rpc("refit_expect", args=(version,))
            asking = all(r.get("asking") for r in replies)
        except Exception as e:  # an optimisation only: the prefetch asks as before
            log.debug("auto-refit: asking ahead for version %d failed: %s", version, e)
        finally:
            self._asked, self._asking = (version, time.monotonic()), asking

    async def _switch(self, version: int, prefetch_s: float) -> None:
        mode = self.config.pause_mode
        paused = time.perf_counter()
        # keep: the requests in flight stay; their KV cache is recomputed below instead.
        await self.engine.pause_generation(mode=mode.value, clear_cache=mode is not PauseMode.KEEP)
        installed = expected = before = False
        stall_s = 0.0
        try:
            results = await self.engine.collective_rpc("refit_to", args=(version,))
            errors = [r for r in results if not r.get("ok")]
            if errors:
                self._fail(version, str(errors[0].get("error")))
                return
            expected = all(r.get("expected") for r in results)
            before = all(r.get("before_readable") for r in results)
            await self.engine.update_weight_version(str(version))
            installed = True
            self.last_error = None
            self._failed.pop(version, None)
            # keep: cached prefixes and the requests in flight hold keys and values computed
            # with the old weights; drop them, so each token after the switch is what the new
            # version computes from the same tokens.
            if mode is PauseMode.KEEP and not await self.engine.reset_prefix_cache(
                reset_running_requests=True
            ):
                log.warning("auto-refit: vLLM could not reset its prefix cache")
        finally:
            try:
                await self.engine.resume_generation()
            finally:
                if installed:
                    # The status shows the version and its switch together, never one alone.
                    stall_s = time.perf_counter() - paused
                    self.installed = version
                    self.switches.append(
                        Switch(version, prefetch_s, stall_s, time.time(), expected, before)
                    )
        if self.newest == version:
            await self._expect(version + 1)
        log.info(
            "auto-refit: serving version %d (prefetch %.3f s beside generation, stall %.3f s)",
            version,
            prefetch_s,
            stall_s,
        )
