"""Checkpoints (megatron dist_checkpointing, with optimizer state) and HF export."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from torch.distributed.checkpoint.api import CheckpointException

from megatron_hf.spec import ModelSpec
from trainer_refit.errors import quoted
from trainer_svc.domain import FailedPrecondition, PathNotAllowed
from trainer_svc.runtime import cpu_compat, host_memory
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
from trainer_svc.runtime.checkpoint_record import record_files
from trainer_svc.runtime.checkpoint_staging import StagedState, Staging, stage
from trainer_svc.runtime.hf_export import (
    ExportSettings,
    export_plan,
    write_index,
    write_stage_files,
)
from trainer_svc.runtime.path_roots import PathRoots
from trainer_svc.runtime.topology import Topology

log = logging.getLogger(__name__)

_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


@dataclass(frozen=True)
class TrainingState:
    """What a checkpoint holds and an export reads, as the engine hands it over: the
    checkpointer saves and loads these, never the engine's own bookkeeping."""

    model: Any
    """The megatron model (its chunks, wrapped for data parallelism or not)."""
    optimizer: Any
    """The megatron optimizer (plain, distributed or chained)."""
    spec: ModelSpec
    topology: Topology


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


def _set_adam_steps(optimizer: object, step: int) -> None:
    """Sets every parameter's Adam step to the checkpoint's optimizer step.

    A load installs tensors only (`checkpoint_staging`), not Adam's steps. Every parameter
    steps together, so the checkpoint's optimizer step is each one's exact value; each gets a
    tensor of its own (torch would advance a shared one once per parameter).
    """
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in inner.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = torch.full_like(state["step"], float(step))


def _cause(error: BaseException, otherwise: str, mismatch: str) -> str:
    """What went wrong, in our words: an OSError's system message (and its file), megatron's
    own refusal (CheckpointingException) as `mismatch`, anything else as `otherwise`; for
    torch's CheckpointException, which gathers every rank's failure, the causes and the ranks.
    No exception's own text is passed on: torch's and pickle's are written for a programmer
    (one advises unpickling with weights_only=False, which runs whatever the file holds)."""
    if isinstance(error, CheckpointException):
        failures = error.failures.values()
        causes = "; ".join(sorted({_cause(e, otherwise, mismatch) for e, _ in failures}))
        ranks = sorted(error.failures)
        where = "rank" if len(ranks) == 1 else "ranks"
        return f"{causes} (seen on {where} {', '.join(map(str, ranks))})"
    if isinstance(error.__cause__, OSError):  # megatron wraps a missing file
        error = error.__cause__
    if isinstance(error, OSError):
        name = f"{Path(str(error.filename)).name}: " if error.filename else ""
        return f"{name}{error.strerror or 'a filesystem error'}"
    if isinstance(error, CheckpointingException):
        return mismatch
    return otherwise


@contextmanager
def _refusals(
    action: str,
    errors: tuple[type[BaseException], ...],
    otherwise: str,
    mismatch: str | None = None,
) -> Iterator[None]:
    """Turns `errors` into FailedPrecondition("`action`: cause", `_cause`), and re-raises a
    FailedPrecondition, without the exception that caused it: the phase then logs the refusal
    as one line per rank, and the traceback goes to DEBUG. torch's CheckpointException is a
    BaseException that torch raises on every rank (it gathers the failures itself); it must
    not escape a phase."""
    try:
        yield
    except FailedPrecondition as e:
        log.debug("%s", action, exc_info=True)
        raise FailedPrecondition(str(e)) from None
    except errors as e:
        log.debug("%s", action, exc_info=True)
        cause = _cause(e, otherwise, mismatch or otherwise)
        raise FailedPrecondition(f"{action}: {cause}") from None


_STORAGE_ERRORS = (OSError, CheckpointingException, CheckpointException)
_UNREADABLE = "its content cannot be read: a file is damaged, or changed after it was verified"
_MISMATCH = "its tensors do not match this model and layout (a name or shape differs)"


def _common_strategy() -> type | None:
    """megatron-core's strategy that reads the common state (`common.pt`) inside its load, on
    the versions that have one (0.16; later versions read that state through torch's reader,
    and their `load` takes no common strategy)."""
    try:
        from megatron.core.dist_checkpointing.strategies import common
    except ImportError:
        return None
    return getattr(common, "TorchCommonLoadStrategy", None)


def _read_common(path: Path) -> dict | None:
    """The common state, read before megatron's load where megatron would read it inside:
    there a failure on one rank would leave that rank outside the load's first collective
    while the others wait in it. None where megatron reads it through torch's reader."""
    strategy = _common_strategy()
    return None if strategy is None else strategy().load_common(path)


def _load_arguments(common: dict | None) -> dict:
    """Hands megatron's load the common state read before it (`_read_common`)."""
    strategy = _common_strategy()
    if strategy is None or common is None:
        return {}

    read: dict = common

    class ReadCommonState(strategy):  # type: ignore[misc, valid-type]
        def load_common(self, checkpoint_dir: str | Path) -> dict:
            return read

    return {"common_strategy": ReadCommonState()}


@dataclass(frozen=True)
class _Prepared:
    """What a load needs before its collectives, made on every rank in a phase."""

    state: TrainerState
    common: dict | None
    sharded: dict
    staging: Staging


@dataclass(frozen=True)
class ReadCheckpoint:
    """A checkpoint that every rank read into staging and checked; nothing live changed yet."""

    path: Path
    optimizer_step: int
    staged: StagedState

    def install(self, training: TrainingState) -> None:
        """Copies the staged tensors into the live parameters and optimizer state and sets
        the optimizer's step to `optimizer_step` (after every rank agreed on the read, on
        every rank)."""
        with cpu_compat.active(), torch.no_grad():
            self.staged.install()
            _set_adam_steps(training.optimizer, self.optimizer_step)
        log.info("loaded checkpoint %s (optimizer step %d)", self.path, self.optimizer_step)


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
        """Verifies every file against the checksums its save recorded (`check_checkpoint`).
        A refusal here is expected (a damaged copy, an old checkpoint): one line in the log."""
        try:
            check_checkpoint(self._checked(path))
        except FailedPrecondition as e:
            log.warning("LoadCheckpoint refused: %s", e)
            raise

    def check_exportable(self, path: Path) -> None:
        check_new_directory(self._checked(path), "export")

    def _sharded_state(self, training: TrainingState) -> dict:
        """The model's and optimizer's sharded state dicts, their ShardedTensors holding the
        live tensors. Built as for a save also when loading: with `is_loading` megatron's
        optimizers change live state (the distributed optimizer reloads its own state dict,
        leaving one step tensor shared by every parameter), which a refused load must not; the
        structure is the same, and `checkpoint_staging` installs the tensors itself."""
        model_state = training.model.sharded_state_dict()
        optimizer_state = training.optimizer.sharded_state_dict(
            model_state, is_loading=False, metadata=_METADATA
        )
        return {"model": model_state, "optimizer": optimizer_state}

    def save(
        self, path: Path, training: TrainingState, *, weights_version: int, optimizer_step: int
    ) -> SaveSummary:
        topology = training.topology
        phase(topology, lambda: make_directory(path, "checkpoint") if topology.is_leader else None)

        def write_shards() -> None:
            action = f"cannot write the checkpoint to {path}"
            with cpu_compat.active(), _refusals(action, _STORAGE_ERRORS, "writing it failed"):
                dist_checkpointing.save(
                    self._sharded_state(training), str(path), content_metadata=_METADATA
                )

        phase(topology, write_shards)

        def write_state() -> None:
            # Written last: LoadCheckpoint refuses a directory without it. Every rank's shards
            # are complete here (the phase above agreed on it), so the record covers them all.
            if topology.is_leader:
                with filesystem_errors(f"cannot record the checkpoint {path}"):
                    info = TrainerState(
                        weights_version=weights_version,
                        optimizer_step=optimizer_step,
                        layout=topology.layout.describe(),
                        files=record_files(path, leave_out=STATE_FILE),
                    )
                    (path / STATE_FILE).write_text(info.to_json())

        phase(topology, write_state)
        log.info("saved checkpoint %s at optimizer step %d", path, optimizer_step)
        return SaveSummary(path, weights_version, optimizer_step)

    def read(self, path: Path, training: TrainingState) -> ReadCheckpoint:
        """Reads the checkpoint into staging tensors on every rank (`checkpoint_staging`) and
        checks them; raises `CommandFailed` on every rank when any rank could not, with no live
        tensor changed. The precheck verified every file against its recorded checksum, but a
        file may change after that and a tensor may not fit this model, so the read never goes
        to the live state. Three phases: what each rank does alone before megatron's load
        (trainer state, common state, staging), the load with its collectives and each rank's
        check after it. `ReadCheckpoint.install` then changes the live state."""
        topology = training.topology
        action = f"cannot load the checkpoint {path}"

        def prepare() -> _Prepared:
            with _refusals(action, (Exception,), _UNREADABLE, _MISMATCH):
                state = TrainerState.read(path)
                common = _read_common(path)
            # Not a refusal when it fails (no host memory for the staging): a fault.
            with cpu_compat.active(), torch.no_grad():
                sharded = self._sharded_state(training)
                staging = stage(sharded)
            return _Prepared(state, common, sharded, staging)

        prepared = phase(topology, prepare)

        def load() -> StagedState:
            with cpu_compat.active(), torch.no_grad():
                with _refusals(action, (Exception, CheckpointException), _UNREADABLE, _MISMATCH):
                    loaded = dist_checkpointing.load(
                        prepared.sharded, str(path), **_load_arguments(prepared.common)
                    )
                return prepared.staging.check(loaded, f"the checkpoint {path}")

        staged = phase(topology, load)
        return ReadCheckpoint(path, prepared.state.optimizer_step, staged)

    def export_hf(
        self,
        path: Path,
        training: TrainingState,
        *,
        weights_version: int,
        settings: ExportSettings,
    ) -> ExportSummary | None:
        """Every stage writes its own files, then rank 0 the index (`hf_export`); each part
        is agreed by every rank, so a failed write on one fails the command on all."""
        topology = training.topology
        phase(topology, lambda: make_directory(path, "export") if topology.is_leader else None)
        plan = export_plan(training.model, training.spec, topology, settings)
        action = f"cannot write the export to {path}"

        def stage_files() -> None:
            baseline = host_memory.reset_peak()
            start = time.monotonic()
            with filesystem_errors(action):
                write_stage_files(training.model, training.spec, topology, plan, path)
            # benchmarks/checkpoint_io.py reads this line.
            log.info(
                "wrote this rank's part of the export in %.2f s, host memory peak +%.1f MiB",
                time.monotonic() - start,
                max(0, host_memory.peak_bytes() - baseline) / (1 << 20),
            )

        phase(topology, stage_files)

        def index() -> None:
            if topology.is_leader:
                with filesystem_errors(action):
                    write_index(plan, path, training.spec, self.hf_source_dir)

        phase(topology, index)
        if not topology.is_leader:
            return None
        tensors = sum(len(f.tensors) for f in plan.files)
        log.info(
            "exported %d tensors (%d bytes, %s) in %d files to %s",
            tensors,
            plan.total_bytes,
            plan.main_dtype,
            len(plan.files),
            path,
        )
        return ExportSummary(path, weights_version, tensors, plan.total_bytes)
