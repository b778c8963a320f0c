"""Rank 0's command queue (`runtime/control.Leader`) with a stand-in engine that pins down the
semantics of queued commands: a BeginTrainStep or TrainMicrobatch is answered once checked,
before it runs; the next command waits for it; a microbatch that fails after its answer fails
its step's later microbatches and its finish until the step is aborted, a begin that fails after
its answer fails them until the step is begun again. The real engine runs the same queue in
every trainer test (tests/trainer: duplicates, refusals, split-step equivalence, rank death)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist

from trainer_svc.domain import FailedPrecondition, LossConfig, OptimizerOverrides, SequenceBatch
from trainer_svc.runtime import commands as cmd
from trainer_svc.runtime.control import Leader

FAULT = r"internal error [0-9a-f]{12}; see the server log"
"""How a later answer quotes a queued command's fault (here a RuntimeError): by its id."""


class _Engine:
    """The parts of StepEngine the leader calls; microbatches run when `gate` opens."""

    def __init__(self, group: Any) -> None:
        self.topology = SimpleNamespace(control_group=group)
        self.open_step: Any = None
        self.gate = threading.Event()
        self.fail: set[str] = set()
        self.ran: list[str] = []
        self.begin_gate = threading.Event()
        self.begin_gate.set()

    def precheck(self, command: cmd.Command) -> Any:
        steps = isinstance(command, cmd.TrainMicrobatch | cmd.FinishStep)
        if steps and (self.open_step is None or self.open_step.step_id != command.step_id):
            raise FailedPrecondition(f"step {command.step_id!r} is not open")
        if isinstance(command, cmd.TrainMicrobatch) and command.request_id in self.open_step.ids:
            return ("duplicate", command.request_id)
        return None

    def open_step_info(self) -> Any:
        return None if self.open_step is None else SimpleNamespace(step_id=self.open_step.step_id)

    def projected_answer(self, command: cmd.BeginStep | cmd.TrainMicrobatch) -> Any:
        if isinstance(command, cmd.BeginStep):
            return ("begun", command.step_id)
        return ("ack", command.request_id, len(self.open_step.ids) + 1)

    def prepare(self, command: cmd.Command) -> cmd.Command:
        return command

    def execute(self, command: cmd.Command) -> Any:
        match command:
            case cmd.BeginStep(step_id=step_id):
                assert self.begin_gate.wait(30)
                self.ran.append(f"begin {step_id}")
                if step_id in self.fail:
                    raise RuntimeError(f"begin {step_id} ran out of memory")
                self.open_step = SimpleNamespace(step_id=step_id, ids=[])
            case cmd.TrainMicrobatch(request_id=request_id):
                assert self.gate.wait(30)
                self.ran.append(request_id)
                if request_id in self.fail:
                    raise RuntimeError(f"{request_id} ran out of memory")
                self.open_step.ids.append(request_id)
            case cmd.FinishStep() | cmd.AbortStep():
                self.ran.append(type(command).__name__)
                self.open_step = None
        return type(command).__name__


@pytest.fixture
def group(tmp_path: Path) -> Iterator[Any]:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


_BATCH = SequenceBatch(tokens=np.arange(4), offsets=np.array([0, 4]))


def _microbatch(step: str, request: str) -> cmd.TrainMicrobatch:
    return cmd.TrainMicrobatch(step_id=step, request_id=request, batch=_BATCH)


def _begin(step: str) -> cmd.BeginStep:
    return cmd.BeginStep(step_id=step, loss=LossConfig(), optimizer=OptimizerOverrides())


def test_a_microbatch_is_answered_before_it_runs_and_the_next_command_waits(group) -> None:
    engine = _Engine(group)

    async def scenario() -> None:
        leader = Leader(engine)  # type: ignore[arg-type]
        await leader.submit(_begin("s"))
        assert await leader.submit(_microbatch("s", "a")) == ("ack", "a", 1)
        assert engine.ran == ["begin s"]  # "a" answered, still waiting to run
        finish = asyncio.ensure_future(leader.submit(cmd.FinishStep(step_id="s")))
        await asyncio.sleep(0.2)
        assert not finish.done()
        engine.gate.set()
        assert await finish == "FinishStep"
        assert engine.ran == ["begin s", "a", "FinishStep"]
        await leader.shutdown()

    asyncio.run(scenario())


def test_a_queued_microbatch_that_fails_fails_its_step_until_it_is_aborted(group) -> None:
    engine = _Engine(group)
    engine.gate.set()
    engine.fail.add("b")

    async def scenario() -> None:
        leader = Leader(engine)  # type: ignore[arg-type]
        await leader.submit(_begin("s"))
        assert await leader.submit(_microbatch("s", "a")) == ("ack", "a", 1)
        assert await leader.submit(_microbatch("s", "b")) == ("ack", "b", 2)
        # "b" failed after its answer: the step's later microbatches and its finish say so,
        # by the error id of the fault, not its text.
        for command in (_microbatch("s", "c"), cmd.FinishStep(step_id="s")):
            with pytest.raises(FailedPrecondition, match=r"failed after .*: " + FAULT) as info:
                await leader.submit(command)
            assert "out of memory" not in str(info.value)
        assert engine.ran == ["begin s", "a", "b"]
        assert await leader.submit(cmd.AbortStep(step_id="s")) == "AbortStep"
        await leader.submit(_begin("t"))
        assert await leader.submit(_microbatch("t", "a")) == ("ack", "a", 1)
        assert await leader.submit(_microbatch("t", "a")) == ("duplicate", "a")
        assert await leader.submit(cmd.FinishStep(step_id="t")) == "FinishStep"
        await leader.shutdown()

    asyncio.run(scenario())


def test_a_begin_is_answered_before_it_runs_and_its_failure_fails_the_step(group) -> None:
    engine = _Engine(group)
    engine.gate.set()
    engine.begin_gate.clear()
    engine.fail.add("s")

    async def scenario() -> None:
        leader = Leader(engine)  # type: ignore[arg-type]
        assert await leader.submit(_begin("s")) == ("begun", "s")
        assert engine.ran == []  # answered, still waiting to run
        assert leader.open_step_info().step_id == "s"  # open from its answer on
        microbatch = asyncio.ensure_future(leader.submit(_microbatch("s", "a")))
        await asyncio.sleep(0.2)
        assert not microbatch.done()  # checked only after the begin ran
        engine.begin_gate.set()
        # The begin failed after its answer: the step's microbatches and finish say so.
        with pytest.raises(FailedPrecondition, match=r"BeginTrainStep .* failed after .*" + FAULT):
            await microbatch
        with pytest.raises(FailedPrecondition, match="begin it again"):
            await leader.submit(cmd.FinishStep(step_id="s"))
        assert engine.ran == ["begin s"]
        assert leader.open_step_info() is None
        # Begun again, the step runs.
        engine.fail.clear()
        assert await leader.submit(_begin("s")) == ("begun", "s")
        assert await leader.submit(_microbatch("s", "a")) == ("ack", "a", 1)
        assert await leader.submit(cmd.FinishStep(step_id="s")) == "FinishStep"
        assert engine.ran == ["begin s", "begin s", "a", "FinishStep"]
        await leader.shutdown()

    asyncio.run(scenario())
