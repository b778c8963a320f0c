"""Checkpoints (megatron dist_checkpointing, with optimizer state) and HF export."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from torch.distributed.checkpoint.api import CheckpointException

from megatron_hf.checkpoint import save_hf_checkpoint
from trainer_refit.errors import quoted
from trainer_svc.domain import FailedPrecondition, PathNotAllowed
from trainer_svc.runtime import cpu_compat
from trainer_svc.runtime.agreement import phase
from trainer_svc.runtime.checkpoint_files import (
    STATE_FILE,
    TrainerState,
    check_checkpoint,
    check_new_directory,
    checked_path,
    filesystem_errors,
    make_directory,
)
from trainer_svc.runtime.path_roots import PathRoots
from trainer_svc.runtime.weights import gather_hf_state

if TYPE_CHECKING:
    from trainer_svc.runtime.engine import StepEngine

log = logging.getLogger(__name__)

_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


@dataclass(frozen=True)
class ExportSummary:
    path: Path
    weights_version: int
    num_tensors: int
    num_bytes: int


@dataclass(frozen=True)
class SaveSummary:
    path: Path
    weights_version: int
    optimizer_step: int


def _restore_zero_step(optimizer_state: dict) -> None:
    """megatron saves Adam's shared step only when it is truthy, so a checkpoint taken before
    the first step has none; torch's Adam then cannot load the state. Put the zero back."""
    state = optimizer_state.get("state")
    if isinstance(state, dict) and state and "common_step" not in state:
        state["common_step"] = torch.zeros((), dtype=torch.float32)


def _set_adam_steps(optimizer: object, step: int) -> None:
    """Sets every parameter's Adam step to the checkpoint's optimizer step.

    megatron's distributed optimizer does not restore torch Adam's per-parameter ``step`` (it
    keeps the live value) and its plain optimizer may share one tensor between parameters, which
    torch would then advance once per parameter. Every parameter steps together, so the
    checkpoint's step count is the exact value; each parameter gets its own tensor.
    """
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in inner.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = torch.full_like(state["step"], float(step))


def _reason(error: BaseException) -> str:
    """The first line of what went wrong (torch's CheckpointException: of each rank's cause)."""
    if isinstance(error, CheckpointException):
        causes = {_reason(exc) for exc, _ in error.failures.values()}
        return "; ".join(sorted(causes))
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


@contextmanager
def _storage_errors(action: str) -> Iterator[None]:
    """Turns what megatron's and torch's checkpoint readers and writers raise for a storage
    problem into FailedPrecondition. torch's CheckpointException is a BaseException that
    torch raises on every rank (it gathers the failures itself); it must not escape a phase."""
    try:
        yield
    except (OSError, CheckpointingException, CheckpointException) as e:
        raise FailedPrecondition(f"{action}: {_reason(e)}") from e


class Checkpointer:
    """Save, load and export on every rank. Rank 0's precheck (`check_*`) refuses what it can
    see is wrong before any rank acts; each step that can still fail on one rank runs as an
    agreed phase (`runtime/agreement.py`) before or after the collectives, never between them,
    so a failure fails the command on every rank and the world keeps serving.

    Paths are confined to `roots` (`runtime/path_roots.py`) in the precheck. A command must
    carry the absolute real path the servicer confined already (`confine`): every rank acts on
    that path as it is, so a relative one, which each rank would resolve on its own, is refused
    here."""

    def __init__(self, hf_source_dir: Path | None, roots: PathRoots) -> None:
        self.hf_source_dir = hf_source_dir
        self.roots = roots

    def confine(self, path: Path) -> Path:
        """The request's path as every rank will use it (rank 0, at the edge)."""
        return self.roots.confine(path)

    def _checked(self, path: Path) -> Path:
        confined = self.roots.confine(checked_path(path))
        if confined != path:
            raise PathNotAllowed(
                f"{quoted(str(path), 160)} resolves to {quoted(str(confined), 160)}: pass the "
                "resolved path, so that every rank uses the directory that was checked"
            )
        return path

    def check_savable(self, path: Path) -> None:
        check_new_directory(self._checked(path), "checkpoint")

    def check_loadable(self, path: Path) -> None:
        check_checkpoint(self._checked(path))

    def check_exportable(self, path: Path) -> None:
        check_new_directory(self._checked(path), "export")

    def _sharded_state(self, engine: StepEngine, *, loading: bool) -> dict:
        model = engine.built.model
        model_state = model.sharded_state_dict()
        optimizer_state = engine.built.optimizer.sharded_state_dict(
            model_state, is_loading=loading, metadata=_METADATA
        )
        return {"model": model_state, "optimizer": optimizer_state}

    def save(self, path: Path, engine: StepEngine) -> SaveSummary:
        topology = engine.topology
        phase(topology, lambda: make_directory(path, "checkpoint") if topology.is_leader else None)

        def write_shards() -> None:
            with cpu_compat.active(), _storage_errors(f"cannot write the checkpoint to {path}"):
                state = self._sharded_state(engine, loading=False)
                dist_checkpointing.save(state, str(path), content_metadata=_METADATA)

        phase(topology, write_shards)
        info = TrainerState(
            weights_version=engine.weights_version,
            optimizer_step=engine.optimizer_step,
            layout=engine.topology.layout.describe(),
        )

        def write_state() -> None:
            # Written last: LoadCheckpoint refuses a directory without it.
            if topology.is_leader:
                with filesystem_errors(f"cannot write {path / STATE_FILE}"):
                    (path / STATE_FILE).write_text(info.to_json())

        phase(topology, write_state)
        log.info("saved checkpoint %s at optimizer step %d", path, engine.optimizer_step)
        return SaveSummary(path, engine.weights_version, engine.optimizer_step)

    def load(self, path: Path, engine: StepEngine) -> None:
        """megatron reads the shards into the live parameters and optimizer state, so a read
        that fails part-way would leave a mix: the precheck (`check_checkpoint`) verifies that
        every shard file the metadata names is there and long enough before any rank reads."""
        topology = engine.topology
        info = phase(topology, lambda: TrainerState.read(path))

        def read() -> dict:
            with cpu_compat.active(), torch.no_grad():
                state = self._sharded_state(engine, loading=True)
                try:
                    return dist_checkpointing.load(state, str(path))
                except (Exception, CheckpointException) as e:
                    # Whatever reading the files raises (unpickling, a torch archive, a shape
                    # that does not fit) says the checkpoint's content is unusable.
                    raise FailedPrecondition(
                        f"cannot load the checkpoint {path}: {_reason(e)}"
                    ) from e

        loaded = phase(topology, read)
        with cpu_compat.active(), torch.no_grad():
            _restore_zero_step(loaded["optimizer"])
            engine.built.model.load_state_dict(loaded["model"])
            engine.built.optimizer.load_state_dict(loaded["optimizer"])
            _set_adam_steps(engine.built.optimizer, info.optimizer_step)
        engine.optimizer_step = info.optimizer_step
        log.info("loaded checkpoint %s (optimizer step %d)", path, engine.optimizer_step)

    def export_hf(self, path: Path, engine: StepEngine) -> ExportSummary | None:
        """The write on rank 0 comes after the last collective; the engine agrees on its
        outcome with every rank."""
        topology = engine.topology
        phase(topology, lambda: make_directory(path, "export") if topology.is_leader else None)
        hf_state = gather_hf_state(engine.built.model, engine.spec, topology)
        if hf_state is None:
            return None
        with filesystem_errors(f"cannot write the export to {path}"):
            save_hf_checkpoint(path, hf_state, self.hf_source_dir)
        num_bytes = sum(t.numel() * t.element_size() for t in hf_state.values())
        log.info("exported %d tensors (%d bytes) to %s", len(hf_state), num_bytes, path)
        return ExportSummary(path, engine.weights_version, len(hf_state), num_bytes)
