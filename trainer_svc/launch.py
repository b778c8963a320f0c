"""Starts a local world of ranks when trainer-svc is not run under torchrun, and supervises it:
SIGINT/SIGTERM shut the world down cleanly, and when a rank fails the world ends with a
non-zero status.

The ranks notice a lost rank themselves (`runtime/liveness.py`): rank 0 answers UNAVAILABLE
naming the rank for a few seconds, then exits; the others exit when rank 0 is gone. So the
launcher leaves them `_SETTLE_SECONDS` to do that before it terminates them, and exits with the
status of the rank that failed first."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import TCPStore

log = logging.getLogger(__name__)

_SHUTDOWN_SECONDS = 60.0
_SETTLE_SECONDS = 20.0
"""After a rank failed, how long the others have to exit on their own (with the default
liveness settings they do within about 10 s) before they are terminated."""
_TERMINATE_SECONDS = 10.0


def rendezvous_store() -> TCPStore:
    """The world's rendezvous store, held by the launcher for the world's lifetime (as
    torchrun's agent does): it binds a free port itself, so no other process can take the port
    between choosing it and the first rank binding it; every rank connects as a client
    (``TORCHELASTIC_USE_AGENT_STORE``)."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def spawn_world(argv: Sequence[str], world_size: int, model_dir: Path) -> int:
    """Runs ``world_size`` copies of ``python -m trainer_svc argv`` as ranks; returns the exit
    code."""
    store = rendezvous_store()
    children: list[subprocess.Popen[bytes]] = []
    for rank in range(world_size):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(store.port),
            TORCHELASTIC_USE_AGENT_STORE="True",
        )
        env.setdefault("OMP_NUM_THREADS", str(_threads_per_rank(world_size)))
        command = [sys.executable, "-m", "trainer_svc", *argv, "--model", str(model_dir)]
        children.append(subprocess.Popen(command, env=env))

    stopping = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            log.info("stopping the trainer (%s)", signal.Signals(signum).name)
            if children[0].poll() is None:
                children[0].send_signal(signal.SIGTERM)

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    return _supervise(children, lambda: stopping)


def _status(code: int) -> int:
    """A child's return code as a shell would report it (a signal N as 128 + N)."""
    return 128 - code if code < 0 else code


def _supervise(children: list[subprocess.Popen[bytes]], stopping: Callable[[], bool]) -> int:
    first_failure: int | None = None
    exited: set[int] = set()
    settle: float | None = None
    deadline: float | None = None
    while True:
        for rank, child in enumerate(children):
            code = child.poll()
            if code is None or rank in exited:
                continue
            exited.add(rank)
            if code != 0 and first_failure is None:
                first_failure = _status(code)
                settle = time.monotonic() + _SETTLE_SECONDS
                log.error("rank %d exited with status %d", rank, first_failure)
            elif first_failure is not None:
                log.info("rank %d exited with status %d", rank, _status(code))
        if len(exited) == len(children):
            return first_failure or 0
        now = time.monotonic()
        if settle is not None and now > settle:
            log.error(
                "stopping the ranks still running %.0f s after a rank failed", _SETTLE_SECONDS
            )
            for child in children:
                if child.poll() is None:
                    child.terminate()
            settle, deadline = None, now + _TERMINATE_SECONDS
        if stopping() and deadline is None and settle is None:
            deadline = now + _SHUTDOWN_SECONDS
        if deadline is not None and now > deadline:
            for child in children:
                if child.poll() is None:
                    child.kill()
        time.sleep(0.1)
