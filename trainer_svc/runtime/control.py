"""Command flow between ranks: rank 0 checks, broadcasts and executes; the others follow.

Rank 0 runs one command at a time, in arrival order, on one thread. BeginTrainStep and
TrainMicrobatch are answered as soon as they are checked (for a microbatch: step open, request
id new or a true duplicate, batch valid) and then executed: the client sends the next command
while this one runs, so the ranks never wait for a round trip between a step's commands. The
next command is checked only after the queued one has run, so checks see every earlier command
applied, and at most one command waits behind the one running. A queued command that fails (on
every rank, as every command) changes no weights; its step answers every later TrainMicrobatch
and FinishTrainStep with the failure until it is aborted (a microbatch) or begun again (a
BeginTrainStep).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist

from trainer_svc.domain import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    OpenStepInfo,
    StepCounts,
)
from trainer_svc.runtime import commands as cmd
from trainer_svc.runtime.agreement import CommandFailed, fault
from trainer_svc.runtime.engine import MicrobatchAck, StepEngine

log = logging.getLogger(__name__)


def _broadcast(command: cmd.Command | None, group: Any) -> cmd.Command:
    if dist.get_world_size(group) == 1:
        assert command is not None
        return command  # a world of one rank: nobody to tell
    box: list[Any] = [command]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


_QUEUED = (cmd.BeginStep, cmd.TrainMicrobatch)
"""The commands answered once checked, before they run."""


@dataclass(frozen=True)
class _QueuedFailure:
    """A command that failed after its answer: its step answers with `error` until it ends."""

    step_id: str
    error: Exception
    begin: bool
    """True when the step's BeginTrainStep failed: the step never opened."""

    def relevant(self, open_step_id: str | None) -> bool:
        """Whether the failure still speaks for the trainer's state: a failed begin while no
        step is open, a failed microbatch while its step is."""
        return open_step_id is None if self.begin else open_step_id == self.step_id

    def error_for(self, step_id: str) -> FailedPrecondition:
        if self.begin:
            return FailedPrecondition(
                f"BeginTrainStep of step {step_id!r} failed after it was acknowledged: "
                f"{self.error}; no step is open: begin it again"
            )
        return FailedPrecondition(
            f"a microbatch of step {step_id!r} failed after it was acknowledged: "
            f"{self.error}; the step changed no weights: abort it"
        )


def follow(engine: StepEngine) -> None:
    """The loop of every rank but 0: apply broadcast commands until Shutdown. A command that
    failed failed on every rank (rank 0 answers it); anything else escaping is a bug."""
    while True:
        command = _broadcast(None, engine.topology.control_group)
        try:
            engine.execute(command)
        except CommandFailed as failed:
            log.debug("%s failed on every rank: %s", type(command).__name__, failed)
        if isinstance(command, cmd.Shutdown):
            return


class WorldLost(Exception):
    """A rank of the world died or stopped responding (`runtime/liveness.py`): no command can
    run any more, and the process is about to exit. Maps to UNAVAILABLE."""


_DOMAIN_ERRORS = (InvalidArgument, FailedPrecondition, Internal)


class Leader:
    """Rank 0's side: one command at a time, on one thread that owns torch.distributed."""

    def __init__(self, engine: StepEngine, *, notice_seconds: float = 2.0) -> None:
        self.engine = engine
        self.notice_seconds = notice_seconds
        """How long a command that failed outside the domain errors waits for a loss to be
        noticed: a collective failing is often how a dead rank first shows on rank 0."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rank0-commands")
        self._lock = asyncio.Lock()
        self._closed = False
        self.lost: str | None = None
        """Why the world is lost (a rank named), once it is."""
        self._lost = asyncio.Event()
        self._queued_failure: _QueuedFailure | None = None
        """An acknowledged command that then failed. Read and written on the command thread
        only."""
        self._acked: MicrobatchAck | None = None
        """The answer of the last microbatch acknowledged and not failed (its counts include
        it), for GetStatus while it runs."""
        self._begun: cmd.BeginStep | None = None
        """A BeginTrainStep answered and not yet run, for GetStatus meanwhile."""

    def world_lost(self, reason: str) -> None:
        """On the event loop: the command running now (its thread may never come back), those
        waiting and every later one answer `WorldLost`."""
        self.lost = reason
        self._lost.set()

    def check_alive(self) -> None:
        if self.lost is not None:
            raise WorldLost(
                f"{self.lost}; the trainer is exiting so that its world is restarted: retry "
                "once it serves again"
            )

    def open_step_info(self) -> OpenStepInfo | None:
        """The open step as GetStatus reports it: open from its answered BeginTrainStep on, its
        counts including every microbatch answered so far, run or still running."""
        info = self.engine.open_step_info()
        begun = self._begun
        if info is None and begun is not None:
            return OpenStepInfo(step_id=begun.step_id, loss=begun.loss, counts=StepCounts())
        acked = self._acked
        if info is None or acked is None or acked.step_id != info.step_id:
            return info
        return replace(info, counts=acked.counts)

    def _check_queued(self, command: cmd.Command) -> None:
        """Raises the failure of a queued command for the later commands of its step."""
        failure = self._queued_failure
        if failure is None:
            return
        open_step = self.engine.open_step
        if not failure.relevant(None if open_step is None else open_step.step_id):
            self._queued_failure = None  # the step ended (aborted, or the trainer reloaded)
            return
        match command:
            case cmd.AbortStep(step_id=s) if s == failure.step_id:
                self._queued_failure = None
            case cmd.BeginStep() if failure.begin:
                self._queued_failure = None
            case cmd.TrainMicrobatch(step_id=s) | cmd.FinishStep(step_id=s) if s == failure.step_id:
                raise failure.error_for(s)

    def _answer(self, command: cmd.BeginStep | cmd.TrainMicrobatch) -> tuple[Any, bool]:
        """(answer, whether the command runs): the answer a checked, queued command gets
        before it runs, or the immediate answer of one that needs no ranks (a duplicate)."""
        self._check_queued(command)
        if isinstance(command, cmd.BeginStep):
            self._acked = None  # a step id may come again
        immediate = self.engine.precheck(command)
        if immediate is not None:
            return immediate, False
        return self.engine.projected_answer(command), True

    def _run_queued(
        self, command: cmd.BeginStep | cmd.TrainMicrobatch, answered: Future[Any]
    ) -> None:
        """A BeginTrainStep or TrainMicrobatch: answered once checked, then executed on
        every rank."""
        try:
            answer, runs = self._answer(command)
        except BaseException as error:
            answered.set_exception(error)
            return
        if not runs:
            answered.set_result(answer)
            return
        if isinstance(command, cmd.BeginStep):
            self._begun = command
        else:
            self._acked = answer
        answered.set_result(answer)
        start = time.perf_counter()
        try:
            self._execute(command)
        except Exception as error:
            self._acked = None
            begin = isinstance(command, cmd.BeginStep)
            what = (
                f"microbatch {command.request_id!r}"
                if isinstance(command, cmd.TrainMicrobatch)
                else "BeginTrainStep"
            )
            if not isinstance(error, _DOMAIN_ERRORS):  # later answers quote it: only its id
                error = fault(error, f"{what} of step {command.step_id!r}")
            self._queued_failure = _QueuedFailure(command.step_id, error, begin)
            log.warning(
                "%s of step %r failed after it was acknowledged: %s", what, command.step_id, error
            )
            return
        finally:
            self._begun = None
        log.debug(
            "queued %s ran in %.3f ms", type(command).__name__, 1e3 * (time.perf_counter() - start)
        )

    def _execute(self, command: cmd.Command) -> Any:
        _broadcast(command, self.engine.topology.control_group)
        try:
            return self.engine.execute(command)
        except CommandFailed as failed:
            raise failed.error from failed

    def _run(self, command: cmd.Command) -> Any:
        self._check_queued(command)
        immediate = self.engine.precheck(command)
        if immediate is not None:
            return immediate
        start = time.perf_counter()
        command = self.engine.prepare(command)
        prepared = time.perf_counter()
        result = self._execute(command)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s: prepare %.3f ms, broadcast and execute %.3f ms",
                type(command).__name__,
                1e3 * (prepared - start),
                1e3 * (time.perf_counter() - prepared),
            )
        return result

    async def submit(self, command: cmd.Command) -> Any:
        """Runs the command on every rank; raises `WorldLost` as soon as the world is lost,
        without waiting for the command's thread."""
        self.check_alive()
        work = asyncio.ensure_future(self._submit(command))
        lost = asyncio.ensure_future(self._lost.wait())
        try:
            done, _ = await asyncio.wait((work, lost), return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            if not work.done():
                work.cancel()  # stops waiting for the command's thread; the thread runs on
        if work not in done:
            self.check_alive()
            raise AssertionError("the world is lost")
        error = work.exception()
        if error is None:
            return work.result()
        if not isinstance(error, _DOMAIN_ERRORS):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lost.wait(), self.notice_seconds)
            self.check_alive()
        raise error

    async def _submit(self, command: cmd.Command) -> Any:
        async with self._lock:
            if self._closed:
                raise RuntimeError("the trainer is shutting down")
            if isinstance(command, _QUEUED):
                answered: Future[Any] = Future()
                self._executor.submit(self._run_queued, command, answered)
                return await asyncio.wrap_future(answered)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, self._run, command)

    async def shutdown(self) -> None:
        async with self._lock:
            if self._closed:
                return
            self._closed = True
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._executor, self._run, cmd.Shutdown())
        self._executor.shutdown(wait=True)
