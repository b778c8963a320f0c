"""Command flow between ranks: rank 0 checks, broadcasts and executes; the others follow."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch.distributed as dist

from trainer_svc.runtime import commands as cmd
from trainer_svc.runtime.agreement import CommandFailed
from trainer_svc.runtime.engine import StepEngine

log = logging.getLogger(__name__)


def _broadcast(command: cmd.Command | None, group: Any) -> cmd.Command:
    box: list[Any] = [command]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


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


class Leader:
    """Rank 0's side: one command at a time, on one thread that owns torch.distributed."""

    def __init__(self, engine: StepEngine) -> None:
        self.engine = engine
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rank0-commands")
        self._lock = asyncio.Lock()
        self._closed = False

    def _run(self, command: cmd.Command) -> Any:
        immediate = self.engine.precheck(command)
        if immediate is not None:
            return immediate
        start = time.perf_counter()
        command = self.engine.prepare(command)
        prepared = time.perf_counter()
        _broadcast(command, self.engine.topology.control_group)
        try:
            result = self.engine.execute(command)
        except CommandFailed as failed:
            raise failed.error from failed
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s: prepare %.3f ms, broadcast and execute %.3f ms",
                type(command).__name__,
                1e3 * (prepared - start),
                1e3 * (time.perf_counter() - prepared),
            )
        return result

    async def submit(self, command: cmd.Command) -> Any:
        async with self._lock:
            if self._closed:
                raise RuntimeError("the trainer is shutting down")
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
