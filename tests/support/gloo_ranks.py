"""A small gloo world of spawned processes for tests of what ranks agree on: each rank runs
`target(rank, store, *args, report)` and sends one dict of outcomes (or its traceback) through
`report`; a rank that reports nothing in time (stuck in a collective) fails the test."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import pytest


def rank_reports(
    target: Callable[..., None], world: int, store: str, *args: Any, timeout_s: float = 120
) -> list[dict[str, Any]]:
    """Each rank's outcomes, in rank order."""
    context = multiprocessing.get_context("spawn")
    pipes, ranks = [], []
    for rank in range(world):
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=target, args=(rank, store, *args, send))
        process.start()
        pipes.append(receive)
        ranks.append(process)
    results = []
    for receive, process in zip(pipes, ranks, strict=True):
        if not receive.poll(timeout_s):
            _kill(ranks)
            pytest.fail(f"a rank did not report within {timeout_s:g} s (stuck in a collective?)")
        result = receive.recv()
        if not isinstance(result, dict):  # its traceback: the others may wait for it forever
            _kill(ranks)
            pytest.fail(f"a rank failed:\n{result}")
        process.join(timeout=30)
        results.append(result)
    return results


def _kill(ranks: list[Any]) -> None:
    for rank in ranks:
        rank.kill()
