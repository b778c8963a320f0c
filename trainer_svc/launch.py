"""Starts a local world of ranks when trainer-svc is not run under torchrun, and supervises it:
if any rank dies the others are stopped, and SIGINT/SIGTERM shut the world down cleanly."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import TCPStore

log = logging.getLogger(__name__)

_SHUTDOWN_SECONDS = 60.0


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
    deadline: float | None = None
    while True:
        codes = [child.poll() for child in children]
        if all(code is not None for code in codes):
            return next((c for c in codes if c), 0)
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed and deadline is None:
            log.error("rank %d exited with %d; stopping the others", *failed[0])
            for child in children:
                if child.poll() is None:
                    child.terminate()
            deadline = time.monotonic() + 10.0
        if stopping and deadline is None:
            deadline = time.monotonic() + _SHUTDOWN_SECONDS
        if deadline is not None and time.monotonic() > deadline:
            for child in children:
                if child.poll() is None:
                    child.kill()
        time.sleep(0.1)
