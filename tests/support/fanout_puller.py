"""Receiver processes for the multi-process fan-out tests: each holds the `Receiver`s of one
layout (one per TP rank, fetching in threads), stays up and refits many versions on command.

Two kinds:

- `PullerProcess`: a persistent receiver process (multiprocessing's spawn context), driven over
  a pipe: `fetch(version, ...)` starts a fetch + install of every rank, `result()` returns what
  each rank installed (its `RefitStats` as a dict and its HF slices as numpy).
- `Zygote`: a process that has imported torch, NIXL, gRPC and the receiver but created no NIXL
  agent and no gRPC channel, so it can `os.fork()` cheap one-shot receivers. `Zygote.victim`
  forks one that fetches a version and SIGKILLs itself once its staging is filled to a given
  fraction: a parent that dies mid-pull, as a crashed node would. The zygote reaps it and
  reports its exit status, so a test can check it really died by SIGKILL.

Messages travel as the frozen dataclasses below; a worker reports its first progress of each
fetch (`Started`) so a test can order receivers' requests to the sidecar.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from tests.support.trainer import kill_tree

Ranges = tuple[tuple[int, int], ...]
Slices = dict[str, tuple[Ranges, np.ndarray]]
"""HF name -> (the box this receiver installs, as (start, stop) per dimension; its values)."""

_GATE_TIMEOUT_S = 30.0
"""How long a held fetch waits for its gate file before it goes on anyway."""


@dataclass(frozen=True)
class PullerConfig:
    """One receiver process: its layout and the refit options of each of its `Receiver`s."""

    sidecar: str
    token_file: str
    model_dir: str
    """A pretrained directory of the trainer's model (its spec and HF names)."""
    receiver_id: str
    tp_size: int = 1
    chunk_bytes: int = 8192
    stall_timeout_s: float = 2.0
    pull_timeout_s: float = 60.0
    lease_ttl_s: float = 60.0
    """A receiver that dies holds its lease until then: the trainer cannot reuse that slot."""


@dataclass(frozen=True)
class Fetch:
    """Fetch and install `version` on every rank."""

    version: int
    throttle_s: float = 0.0
    """Sleep this long as each chunk lands (in the pull's loop), so the pull lasts long enough
    for children to read behind it."""
    gate: str | None = None
    """A file path: once the first progress is out, the pull waits until it exists (the copy
    has started and is offered, but advances no further until the test says so)."""
    kill_at: float | None = None
    """Victims only: SIGKILL the process once filled / total reaches this fraction."""
    corrupt: bool = False
    """Victims only: once a quarter of the copy is filled, flip a byte in the middle of what is
    filled, then say the pull started (so a child, reading after that, reads the flipped
    byte): the copy it serves is corrupt."""
    visible_timeout_s: float | None = None
    """How long a version not readable yet is waited for (default: the receiver's option)."""


@dataclass(frozen=True)
class Expect:
    """Every rank asks ahead for `version` (`Receiver.expect`); answered with `Expected`."""

    version: int


@dataclass(frozen=True)
class Expected:
    version: int


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Ready:
    pid: int
    agents: tuple[str, ...]


@dataclass(frozen=True)
class Started:
    """A rank's first progress of a fetch: its sources are assigned and bytes are landing."""

    agent: str
    filled: int
    total: int


@dataclass(frozen=True)
class Killing:
    """A victim's last word: it SIGKILLs itself right after this, at `at` (time.time())."""

    agent: str
    filled: int
    total: int
    at: float


@dataclass(frozen=True)
class RankResult:
    agent: str
    stats: dict[str, Any]
    """`RefitStats.to_dict()`."""
    slices: Slices


@dataclass(frozen=True)
class Fetched:
    version: int
    ranks: tuple[RankResult, ...]


@dataclass(frozen=True)
class Failed:
    version: int
    error: str


@dataclass(frozen=True)
class Exited:
    """The zygote reaped a victim: `code` as multiprocessing reports it (-9: SIGKILL)."""

    pid: int
    code: int


@dataclass
class _Ranks:
    """The `Receiver`s of one process, built after the (spawned or forked) process started."""

    config: PullerConfig
    receivers: list[Any] = field(default_factory=list)

    def build(self) -> None:
        import torch

        from inference_ext.receiver import Receiver
        from inference_ext.refit_options import FanOutOptions, ReceiverAuth, RefitOptions
        from inference_ext.slices import ReceiverLayout
        from megatron_hf.convert import hf_names
        from megatron_hf.spec import ModelSpec

        torch.set_num_threads(1)
        config = self.config
        spec = _wait_for_spec(ModelSpec, Path(config.model_dir))
        names = hf_names(spec)
        options = RefitOptions(
            receiver_id=config.receiver_id,
            fanout=FanOutOptions(
                enabled=True,
                chunk_bytes=config.chunk_bytes,
                stall_timeout_s=config.stall_timeout_s,
            ),
            pull_timeout_s=config.pull_timeout_s,
            lease_ttl_s=config.lease_ttl_s,
            auth=ReceiverAuth(token_file=config.token_file),
        )
        for rank in range(config.tp_size):
            layout = ReceiverLayout(tp_size=config.tp_size, tp_rank=rank)
            self.receivers.append(
                Receiver(
                    config.sidecar,
                    spec,
                    layout,
                    names,
                    options=options,
                    device=torch.device("cpu"),
                )
            )

    @property
    def agents(self) -> tuple[str, ...]:
        return tuple(r.agent for r in self.receivers)

    def fetch(self, command: Fetch, send: Callable[[object], None]) -> Fetched | Failed:
        """Every rank fetches and installs `command.version` at once (one thread each)."""
        results: dict[int, RankResult] = {}
        errors: list[str] = []

        def run(index: int, receiver: Any) -> None:
            try:
                results[index] = _fetch_one(receiver, command, send)
            except Exception as e:
                errors.append(f"{receiver.agent}: {type(e).__name__}: {e}")

        threads = [
            threading.Thread(target=run, args=(i, r), name=f"fetch-{r.agent}")
            for i, r in enumerate(self.receivers)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            return Failed(command.version, "; ".join(errors))
        return Fetched(command.version, tuple(results[i] for i in range(len(self.receivers))))

    def close(self) -> None:
        for receiver in self.receivers:
            receiver.close()


@contextlib.contextmanager
def _paced(receiver: Any, command: Fetch, started: threading.Event) -> Iterator[None]:
    """The pull's loop slowed down as `command` says: it sleeps `throttle_s` as each chunk
    lands, and once the first progress is out (`started`) it waits for the gate. (Progress is
    published from a thread of its own: sleeping there would slow the copy's word, not the
    pull.)"""
    from refit_sidecar.pull.progress import PROGRESS_BYTES

    transport = receiver.transport
    check = transport.check
    gate = Path(command.gate) if command.gate is not None else None

    def paced(posted: Any) -> bool:
        nonlocal gate
        done: bool = check(posted)
        if gate is not None and started.is_set():
            _wait_for(gate)
            gate = None
        if done and posted.xfer.nbytes > PROGRESS_BYTES and command.throttle_s:
            time.sleep(command.throttle_s)
        return done

    transport.check = paced
    try:
        yield
    finally:
        del transport.check  # the class's method again


def _fetch_one(receiver: Any, command: Fetch, send: Callable[[object], None]) -> RankResult:
    agent = receiver.agent
    calls = 0
    started = threading.Event()

    def on_progress(filled: int, total: int) -> None:
        nonlocal calls
        if command.corrupt and calls == 0:
            if filled <= total // 4:
                return
            # Nobody reads this copy before `Started`: its children read the flipped byte.
            from refit_sidecar.memory.region import host_view

            host_view(receiver.staging.region)[filled // 2] ^= 0xFF
        calls += 1
        if calls == 1:
            send(Started(agent, filled, total))
            started.set()
        if command.kill_at is not None and filled < total and filled >= command.kill_at * total:
            send(Killing(agent, filled, total, time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    with _paced(receiver, command, started):
        receiver.fetch(
            command.version, on_progress=on_progress, visible_timeout_s=command.visible_timeout_s
        )
    stats = receiver.install(lambda tensors: [None for _ in tensors])
    slices: Slices = {
        name: (box.ranges, tensor.numpy()) for name, (box, tensor) in receiver.slices().items()
    }
    return RankResult(agent, stats.to_dict(), slices)


def _wait_for_spec(spec_type: Any, model_dir: Path, timeout: float = 300.0) -> Any:
    """The model's spec once the trainer has written its config (workers start alongside the
    trainer, which writes its built-in model as it starts)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return spec_type.from_pretrained_dir(model_dir)
        except ValueError:  # no config.json yet, or half written
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + _GATE_TIMEOUT_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.002)


def _sender(conn: Connection) -> Callable[[object], None]:
    lock = threading.Lock()

    def send(message: object) -> None:
        with lock:
            conn.send(message)

    return send


def _puller_main(config: PullerConfig, conn: Connection) -> None:
    ranks = _Ranks(config)
    ranks.build()
    send = _sender(conn)
    send(Ready(os.getpid(), ranks.agents))
    try:
        while True:
            command = conn.recv()
            if isinstance(command, Stop):
                break
            if isinstance(command, Expect):
                for receiver in ranks.receivers:
                    receiver.expect(command.version)
                send(Expected(command.version))
                continue
            try:
                send(ranks.fetch(command, send))
            except Exception:
                send(Failed(command.version, traceback.format_exc()))
    finally:
        ranks.close()


def _zygote_main(conn: Connection) -> None:
    # What every victim needs, imported once here: forked children start with it loaded.
    import grpc  # noqa: F401
    import nixl  # noqa: F401
    import torch  # noqa: F401

    import inference_ext.receiver  # noqa: F401
    import megatron_hf.convert  # noqa: F401

    conn.send(Ready(os.getpid(), ()))
    while True:
        command = conn.recv()
        if isinstance(command, Stop):
            return
        config, fetch = command
        pid = os.fork()
        if pid == 0:
            _victim_main(config, fetch, conn)  # never returns
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        conn.send(Exited(pid, code))


def _victim_main(config: PullerConfig, fetch: Fetch, conn: Connection) -> None:
    """A forked receiver: while it lives it alone writes to the pipe (the zygote waits)."""
    code = 1
    ranks = None
    try:
        ranks = _Ranks(config)
        ranks.build()
        send = _sender(conn)
        send(Ready(os.getpid(), ranks.agents))
        send(ranks.fetch(fetch, send))
        code = 0
    except BaseException:
        conn.send(Failed(fetch.version, traceback.format_exc()))
    finally:
        if ranks is not None:  # a victim that lived leaves no progress file behind
            with contextlib.suppress(Exception):
                ranks.close()
        os._exit(code)


def _names(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


class _Channel:
    """The test's end of a worker's pipe: messages of one kind are awaited, others kept."""

    def __init__(self, conn: Connection, name: str, alive: Callable[[], bool]) -> None:
        self._conn = conn
        self._name = name
        self._alive = alive
        self._pending: list[object] = []

    def expect(
        self,
        kind: type | tuple[type, ...],
        timeout: float,
        match: Callable[[Any], bool] | None = None,
    ) -> Any:
        """The next message of `kind` (and `match`), one received meanwhile included."""

        def wanted(message: object) -> bool:
            return isinstance(message, kind) and (match is None or match(message))

        for i, message in enumerate(self._pending):
            if wanted(message):
                return self._pending.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self._name}: no {_names(kind)} within {timeout} s")
            if not self._conn.poll(min(left, 0.5)):
                if not self._alive():
                    raise RuntimeError(f"{self._name} died waiting for {_names(kind)}")
                continue
            try:
                message = self._conn.recv()
            except EOFError as e:
                raise RuntimeError(f"{self._name} closed its pipe") from e
            if wanted(message):
                return message
            if isinstance(message, Failed) and kind in (Fetched, Started):
                raise RuntimeError(
                    f"{self._name}: fetch of version {message.version} failed:\n{message.error}"
                )
            self._pending.append(message)

    def take(self, kind: type) -> list[Any]:
        """Every message of `kind` received so far (polling what is waiting in the pipe)."""
        while self._conn.poll(0):
            try:
                self._pending.append(self._conn.recv())
            except EOFError:
                break
        taken = [m for m in self._pending if isinstance(m, kind)]
        self._pending = [m for m in self._pending if not isinstance(m, kind)]
        return taken


class PullerProcess:
    """A persistent receiver process of one layout; start several, then `wait_ready` each."""

    def __init__(self, config: PullerConfig) -> None:
        self.config = config
        context = multiprocessing.get_context("spawn")
        mine, theirs = context.Pipe()
        self._process = context.Process(
            target=_puller_main, args=(config, theirs), name=config.receiver_id, daemon=True
        )
        self._process.start()
        theirs.close()
        self._conn = mine
        self.channel = _Channel(mine, f"receiver {config.receiver_id}", self._process.is_alive)
        self.agents: tuple[str, ...] = ()

    def wait_ready(self, timeout: float = 120.0) -> None:
        self.agents = self.channel.expect(Ready, timeout).agents

    def fetch(
        self, version: int, *, throttle_s: float = 0.0, visible_timeout_s: float | None = None
    ) -> None:
        """Start fetching `version` (returns at once; `result` waits)."""
        self._conn.send(Fetch(version, throttle_s=throttle_s, visible_timeout_s=visible_timeout_s))

    def expect(self, version: int, timeout: float = 30.0) -> None:
        """Every rank asks ahead for `version`; returns once they have."""
        self._conn.send(Expect(version))
        self.channel.expect(Expected, timeout, lambda m: m.version == version)

    def wait_started(self, agent: str | None = None, timeout: float = 30.0) -> Started:
        """The first progress of the fetch under way (of rank `agent`, or of any rank)."""
        return self.channel.expect(
            Started, timeout, None if agent is None else (lambda m: m.agent == agent)
        )

    def result(self, timeout: float = 90.0) -> Fetched | Failed:
        """The outcome of the fetch started last: Fetched, or Failed (a RefitError's text)."""
        deadline = time.monotonic() + timeout
        while True:
            outcome = self.channel.take(Fetched) + self.channel.take(Failed)
            if outcome:
                assert len(outcome) == 1, outcome
                self.channel.take(Started)  # this fetch's, done with
                return outcome[0]
            if time.monotonic() > deadline:
                raise TimeoutError(f"receiver {self.config.receiver_id}: no result in {timeout} s")
            if not self._process.is_alive():
                raise RuntimeError(f"receiver {self.config.receiver_id} died")
            self._conn.poll(0.05)

    def stop(self) -> None:
        """Close the receivers and end the process; kill it (and anything it started) if it
        does not end promptly."""
        try:
            if self._process.is_alive():
                self._conn.send(Stop())
            self._process.join(timeout=15)
        except (BrokenPipeError, OSError):
            pass
        finally:
            _kill(self._process)
            self._conn.close()


class Zygote:
    """Forks one-shot receivers ("victims") that die by SIGKILL mid-pull."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        mine, theirs = context.Pipe()
        self._process = context.Process(
            target=_zygote_main, args=(theirs,), name="zygote", daemon=True
        )
        self._process.start()
        theirs.close()
        self._conn = mine
        self.channel = _Channel(mine, "zygote", self._process.is_alive)

    def wait_ready(self, timeout: float = 120.0) -> None:
        self.channel.expect(Ready, timeout)

    def victim(
        self,
        config: PullerConfig,
        version: int,
        *,
        kill_at: float | None = None,
        corrupt: bool = False,
        throttle_s: float,
        gate: Path,
    ) -> Victim:
        """Fork a receiver that fetches `version`, holds at its first progress until `gate`
        exists, then goes on with `throttle_s` per progress call and SIGKILLs itself once
        `kill_at` of its staging is filled (or, with `corrupt`, serves a copy whose first byte
        it flipped)."""
        fetch = Fetch(
            version, throttle_s=throttle_s, gate=str(gate), kill_at=kill_at, corrupt=corrupt
        )
        self._conn.send((config, fetch))
        return Victim(self.channel, gate)

    def stop(self) -> None:
        try:
            if self._process.is_alive():
                self._conn.send(Stop())
            self._process.join(timeout=10)
        except (BrokenPipeError, OSError):
            pass
        finally:
            _kill(self._process)
            self._conn.close()


@dataclass
class Victim:
    channel: _Channel
    gate: Path
    pid: int = 0

    def wait_started(self, timeout: float = 60.0) -> Started:
        self.pid = self.channel.expect(Ready, timeout).pid
        return self.channel.expect(Started, timeout)

    def release(self) -> None:
        """Let the held pull go on."""
        self.gate.touch()

    def result(self, timeout: float = 60.0) -> Fetched | Failed:
        """The outcome of a victim that was not killed."""
        outcome: Fetched | Failed = self.channel.expect((Fetched, Failed), timeout)
        return outcome

    def wait_exit(self, timeout: float = 60.0) -> tuple[Exited, list[Killing]]:
        """The zygote's report of its exit, and the victim's last words (if it killed itself)."""
        exited = self.channel.expect(Exited, timeout)
        return exited, self.channel.take(Killing)


def _kill(process: Any) -> None:
    import psutil

    if process.pid is None:
        return
    with contextlib.suppress(psutil.NoSuchProcess):
        kill_tree(psutil.Process(process.pid))
    process.join(timeout=10)
