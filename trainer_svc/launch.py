"""Starts a local world of ranks when trainer-svc is not run under torchrun, and supervises it:
SIGINT/SIGTERM shut the world down cleanly, and when a rank fails the world ends with a
non-zero status. A CPU world's ranks are forked from the launcher once it has imported what they
import; a GPU world's are new interpreters (docs/architecture.md, "A rank that dies").

The ranks notice a lost rank themselves (`runtime/liveness.py`): rank 0 answers UNAVAILABLE
naming the rank for a few seconds, then exits; the others exit when rank 0 is gone. So the
launcher leaves them `_SETTLE_SECONDS` to do that before it terminates them, and exits with the
status of the rank that failed first."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.process
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch.distributed import TCPStore

log = logging.getLogger(__name__)

_SHUTDOWN_SECONDS = 60.0
_SETTLE_SECONDS = 20.0
"""After a rank failed, how long the others have to exit on their own (with the default
liveness settings they do within about 10 s) before they are terminated."""
_TERMINATE_SECONDS = 10.0
_PR_SET_NAME = 15


def rendezvous_store() -> TCPStore:
    """The world's rendezvous store, held by the launcher for the world's lifetime (as
    torchrun's agent does): it binds a free port itself, so no other process can take the port
    between choosing it and the first rank binding it; every rank connects as a client
    (``TORCHELASTIC_USE_AGENT_STORE``)."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


class RankProcess(Protocol):
    """What the supervisor needs of a rank's process (`subprocess.Popen` has it)."""

    def poll(self) -> int | None: ...

    def send_signal(self, signum: int, /) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class ForkedRank:
    """A rank forked from the launcher (a `multiprocessing` process of the fork context, so
    the rank starts with multiprocessing's own state reset, as megatron's checkpoint writer
    needs when it starts processes of its own), with the part of `subprocess.Popen`'s interface
    the supervisor uses."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    def poll(self) -> int | None:
        """The exit code once the rank exited (-N for signal N, as Popen reports it)."""
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _preload() -> None:
    """Imports what every rank imports (torch, megatron-core, transformers, gRPC) once, in the
    launcher, so a forked rank starts with them loaded instead of importing them again: each
    rank's import is most of a small world's start-up CPU."""
    import trainer_svc.runtime.rank  # noqa: F401


RankEntry = Callable[[list[str]], None]
"""A rank's entry point, given its argv (``trainer_svc.__main__.main``)."""


def _forked_rank_main(
    *,
    entry: RankEntry,
    argv: list[str],
    env: dict[str, str],
    threads: int,
    read_end: int,
    close: tuple[int, ...],
) -> None:
    """A forked rank's body: waits for the rendezvous port on its pipe (the store is made after
    every fork, so no rank inherits the store's server thread), then runs as
    ``python -m trainer_svc argv`` would with `env`."""
    for fd in close:
        os.close(fd)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with os.fdopen(read_end, "rb") as port:
        master_port = port.readline().decode().strip()
    if not master_port:
        raise SystemExit(1)  # the launcher gave up before the world started
    os.environ.update(env, MASTER_PORT=master_port)
    import torch

    # OMP_NUM_THREADS is read when the OpenMP runtime loads, before the fork.
    torch.set_num_threads(threads)
    try:
        entry(argv)
    finally:
        # Flush what the rank logged: multiprocessing ends the process without the
        # interpreter's exit handlers.
        logging.shutdown()


def _fork_rank(
    entry: RankEntry, argv: Sequence[str], env: dict[str, str], threads: int, earlier: Sequence[int]
) -> tuple[ForkedRank, int]:
    """Forks a rank. `earlier`: the earlier ranks' pipes, which this rank must not hold open.
    Returns the rank and its pipe's writing end."""
    read_end, write_end = os.pipe()
    context = multiprocessing.get_context("fork")
    process = context.Process(
        target=_forked_rank_main,
        kwargs=dict(
            entry=entry,
            argv=list(argv),
            env=env,
            threads=threads,
            read_end=read_end,
            close=(write_end, *earlier),
        ),
        name=f"trainer-rank{env['RANK']}",
    )
    process.start()
    os.close(read_end)
    return ForkedRank(process), write_end


def name_process(name: str) -> None:
    """Names this process (Linux: /proc/PID/comm, what `ps -o comm` and `top` show), so a
    rank is told apart from its launcher and the other ranks."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _rank_env(rank: int, world_size: int) -> dict[str, str]:
    return dict(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        TORCHELASTIC_USE_AGENT_STORE="True",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(_threads_per_rank(world_size))),
    )


def _fork_world(
    entry: RankEntry, argv: Sequence[str], world_size: int
) -> tuple[list[RankProcess], TCPStore] | None:
    """The ranks forked from this process, and the store they meet at; None where forking is
    unsafe (CUDA was initialised here, which a forked rank cannot use)."""
    _preload()
    import torch

    if torch.cuda.is_initialized():
        return None
    children: list[RankProcess] = []
    ports: list[int] = []
    try:
        for rank in range(world_size):
            env = _rank_env(rank, world_size)
            child, port = _fork_rank(entry, argv, env, _threads_per_rank(world_size), ports)
            children.append(child)
            ports.append(port)
        store = rendezvous_store()
        for port in ports:
            os.write(port, f"{store.port}\n".encode())
    finally:
        for port in ports:
            os.close(port)  # a rank that read no port exits
    return children, store


def _spawn_world(argv: Sequence[str], world_size: int) -> tuple[list[RankProcess], TCPStore]:
    """The ranks as new interpreters (``python -m trainer_svc argv``), each importing all it
    needs, and the store they meet at."""
    store = rendezvous_store()
    children: list[RankProcess] = []
    for rank in range(world_size):
        env = {**os.environ, **_rank_env(rank, world_size), "MASTER_PORT": str(store.port)}
        command = [sys.executable, "-m", "trainer_svc", *argv]
        children.append(subprocess.Popen(command, env=env))
    return children, store


def spawn_world(
    argv: Sequence[str], world_size: int, model_dir: Path, *, fork: RankEntry | None
) -> int:
    """Runs ``world_size`` ranks of ``trainer-svc argv``; returns the world's exit code.

    `fork`: the ranks' entry point, to fork them from this process once it has imported what
    they import (a CPU world); None, or where forking is unsafe: start each as a new
    interpreter. A GPU world is
    never forked: CUDA cannot be used in a child forked after the parent touched it, and its
    host has the cores to import in parallel."""
    rank_argv = [*argv, "--model", str(model_dir)]
    world = _fork_world(fork, rank_argv, world_size) if fork is not None else None
    children, store = world or _spawn_world(rank_argv, world_size)
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
    code = _supervise(children, lambda: stopping)
    del store  # held for the world's lifetime, as torchrun's agent holds it
    return code


def _status(code: int) -> int:
    """A child's return code as a shell would report it (a signal N as 128 + N)."""
    return 128 - code if code < 0 else code


def _supervise(children: Sequence[RankProcess], stopping: Callable[[], bool]) -> int:
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
