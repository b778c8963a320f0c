"""Device time of a piece of GPU work, for the GPU tests that print timings."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def median_ms(run: Callable[[], object], *, warmup: int = 3, iterations: int = 10) -> float:
    """The median over `iterations` calls of `run` (after `warmup` untimed ones) of the device
    time between CUDA events recorded around it, in milliseconds."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
