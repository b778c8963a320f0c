"""Runs a test body in a fresh spawned process.

For tests that leave native state behind on purpose (a NIXL/UCX worker whose peer was killed):
its teardown then happens in a process that exits right away, never inside the pytest process
where a later garbage collection could run it in the middle of another test.
"""

from __future__ import annotations

import functools
import importlib
import multiprocessing
import traceback
from collections.abc import Callable
from typing import Any


def _run(module: str, name: str, args: tuple, kwargs: dict, report: Any) -> None:
    test = getattr(importlib.import_module(module), name).__wrapped__
    try:
        test(*args, **kwargs)
    except BaseException:
        report.send(traceback.format_exc())
    else:
        report.send(None)


def in_child_process(test: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(test)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        context = multiprocessing.get_context("spawn")
        receive, send = context.Pipe(duplex=False)
        child = context.Process(
            target=_run, args=(test.__module__, test.__name__, args, kwargs, send)
        )
        child.start()
        send.close()
        try:
            failure = receive.recv()
        except EOFError:
            child.join()
            failure = f"the child process died before reporting (exit code {child.exitcode})"
        child.join()
        if failure is not None:
            raise AssertionError(f"the test failed in its child process:\n{failure}")

    return wrapper
