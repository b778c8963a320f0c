"""Starts a local world of ranks when trainer-svc is not run under torchrun, and supervises it:
SIGINT/SIGTERM shut the world down cleanly, and when a rank fails the world ends with a
non-zero status. The ranks are forked from the launcher once it has imported what they import
(docs/architecture.md, "A rank that dies").

The ranks notice a lost rank themselves (`runtime/liveness.py`): rank 0 answers UNAVAILABLE
naming the rank for a few seconds, then exits; the others exit when rank 0 is gone. So the
launcher leaves them `_SETTLE_SECONDS` to do that before it terminates them, and exits with the
status of the rank that failed first."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing.util
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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


@dataclass
class ForkedRank:
    """A rank forked from the launcher, with the part of `subprocess.Popen`'s interface the
    supervisor uses."""

    pid: int
    returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once the rank exited (-N for signal N, as Popen reports it)."""
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

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


def _fork_rank(
    argv: Sequence[str], env: dict[str, str], threads: int, earlier: Sequence[int]
) -> tuple[ForkedRank, int]:
    """Forks a rank: it waits for the rendezvous port on a pipe (the store is made after every
    fork, so no rank inherits the store's server thread), then runs as
    ``python -m trainer_svc argv`` would with `env`. `earlier`: the earlier ranks' pipes, which
    this rank must not hold open. Returns the rank and its pipe's writing end."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid:
        os.close(read_end)
        return ForkedRank(pid), write_end
    code = 1
    try:
        for fd in (write_end, *earlier):
            os.close(fd)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with os.fdopen(read_end, "rb") as port:
            master_port = port.readline().decode().strip()
        if not master_port:
            raise SystemExit(1)  # the launcher gave up before the world started
        os.environ.update(env, MASTER_PORT=master_port)
        _name_process(f"trainer-rank{env['RANK']}")
        import torch

        # OMP_NUM_THREADS is read when the OpenMP runtime loads, before the fork.
        torch.set_num_threads(threads)
        from trainer_svc.__main__ import main

        main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        # The rank never returns into the launcher's frames. What the interpreter's exit would
        # do for a rank: end the processes megatron's checkpoint writer started, flush.
        with contextlib.suppress(BaseException):
            multiprocessing.util._exit_function()  # type: ignore[attr-defined]
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    raise AssertionError("unreachable")


def _name_process(name: str) -> None:
    """Names this process (Linux: /proc/PID/comm, what `ps -o comm` and `top` show), so a
    forked rank is told apart from its launcher."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def spawn_world(argv: Sequence[str], world_size: int, model_dir: Path) -> int:
    """Runs ``world_size`` ranks of ``trainer-svc argv``, forked from this process once it has
    imported what they need; returns the world's exit code."""
    _preload()
    threads = _threads_per_rank(world_size)
    rank_argv = [*argv, "--model", str(model_dir)]
    children: list[ForkedRank] = []
    ports: list[int] = []
    try:
        for rank in range(world_size):
            env = dict(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                TORCHELASTIC_USE_AGENT_STORE="True",
                OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(threads)),
            )
            child, port = _fork_rank(rank_argv, env, threads, ports)
            children.append(child)
            ports.append(port)
        store = rendezvous_store()
        for port in ports:
            os.write(port, f"{store.port}\n".encode())
    finally:
        for port in ports:
            os.close(port)  # a rank that read no port exits
    stopping = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            log.info("stopping the trainer (%s)", signal.Signals(signum).name)
            children[0].send_signal(signal.SIGTERM)

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    code = _supervise(children, lambda: stopping)
    del store  # held for the world's lifetime, as torchrun's agent holds it
    return code


def _status(code: int) -> int:
    """A child's return code as a shell would report it (a signal N as 128 + N)."""
    return 128 - code if code < 0 else code


def _supervise(children: list[ForkedRank], stopping: Callable[[], bool]) -> int:
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
