"""This process's resident host memory and its peak, from /proc (Linux): how much a phase such
as loading the checkpoint grew the process by at its worst. Elsewhere both read as 0."""

from __future__ import annotations

import contextlib
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int:
    with contextlib.suppress(OSError):
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def resident_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def reset_peak() -> int:
    """Starts a new peak at the current resident size (writing 5 to clear_refs resets the
    kernel's high-water mark); returns that size, the phase's baseline."""
    with contextlib.suppress(OSError):
        _CLEAR_REFS.write_text("5")
    return resident_bytes()


def peak_bytes() -> int:
    """The highest resident size since the last `reset_peak` (or the process's start)."""
    return _status_kib("VmHWM") * 1024
