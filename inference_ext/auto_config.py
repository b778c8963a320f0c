"""How a ``vllm serve`` replica follows the trainer by itself: the ``auto`` entry of
``--additional-config '{"refit": {"sidecar": ..., "auto": ...}}'``.

``"auto": true`` follows with the defaults below, ``false`` (or no entry) does not follow, and an
object sets the fields by name::

    "auto": {"policy": "latest", "pause_mode": "keep", "max_staleness": 2}

`auto_refit.AutoRefit` acts on it; docs/inference.md ("Auto-refit") describes the behaviour.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


class FollowPolicy(enum.Enum):
    """Which published versions an engine installs."""

    LATEST = "latest"
    """The newest published version each time the engine is ready to switch; versions
    published meanwhile are skipped."""
    EVERY = "every"
    """Every version in order (unless `max_staleness` is exceeded: then the newest)."""


class PauseMode(enum.Enum):
    """What happens to requests in flight at a switch (vLLM's pause modes)."""

    KEEP = "keep"
    """They are frozen for the install and go on with the new weights, their keys and values
    recomputed from their tokens: the stall is the install (plus that recomputation); a
    completion may span versions (its ``weight_versions`` spans say which tokens came from
    which)."""
    WAIT = "wait"
    """New requests wait while those in flight finish on the old weights: every completion
    comes from one version; the stall lasts as long as the longest request in flight."""
    ABORT = "abort"
    """They are aborted (their clients see an aborted finish) and the switch happens at once."""


@dataclass(frozen=True, kw_only=True)
class AutoRefitConfig:
    policy: FollowPolicy = FollowPolicy.LATEST
    pause_mode: PauseMode = PauseMode.KEEP
    max_staleness: int | None = None
    """The most versions the served one may trail the newest published one. Beyond it the
    engine reports itself not ready (``/trainer_refit/ready`` answers 503) and the `EVERY`
    policy skips ahead to the newest. None: no limit."""
    poll_interval_s: float = 0.05
    """How often the workers' prefetch is checked while it runs."""
    retry_interval_s: float = 2.0
    """How long after a failed refit the same version is not tried again, doubling with each
    failure of it up to a minute (a newer version is tried at once)."""

    def __post_init__(self) -> None:
        if not isinstance(self.policy, FollowPolicy):
            raise ValueError(f"policy must be a FollowPolicy, got {self.policy!r}")
        if not isinstance(self.pause_mode, PauseMode):
            raise ValueError(f"pause_mode must be a PauseMode, got {self.pause_mode!r}")
        staleness = self.max_staleness
        if staleness is not None and (
            isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0
        ):
            raise ValueError(f"max_staleness must be an integer >= 0 or null, got {staleness!r}")
        for name in ("poll_interval_s", "retry_interval_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")

    @classmethod
    def from_value(cls, value: Any) -> AutoRefitConfig | None:
        """The ``auto`` entry's value: None when the engine does not follow by itself."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if not isinstance(value, Mapping):
            raise ValueError(f'refit "auto" must be true, false or an object, got {value!r}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f'unknown refit "auto" field(s) {unknown}; known: {sorted(known)}')
        values = dict(value)
        try:
            if "policy" in values:
                values["policy"] = FollowPolicy(values["policy"])
            if "pause_mode" in values:
                values["pause_mode"] = PauseMode(values["pause_mode"])
        except ValueError as e:
            raise ValueError(f'refit "auto": {e}') from None
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy.value,
            "pause_mode": self.pause_mode.value,
            "max_staleness": self.max_staleness,
            "poll_interval_s": self.poll_interval_s,
            "retry_interval_s": self.retry_interval_s,
        }
