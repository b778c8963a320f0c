"""Checkpoints (megatron dist_checkpointing, with optimizer state) and HF export."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megatron_hf.checkpoint import save_hf_checkpoint
from trainer_svc.domain import FailedPrecondition, InvalidArgument
from trainer_svc.runtime import cpu_compat
from trainer_svc.runtime.weights import gather_hf_state

if TYPE_CHECKING:
    from trainer_svc.runtime.engine import StepEngine

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
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


class Checkpointer:
    def __init__(self, hf_source_dir: Path | None) -> None:
        self.hf_source_dir = hf_source_dir

    @staticmethod
    def _absolute(path: Path) -> Path:
        if not path.is_absolute():
            raise InvalidArgument(f"checkpoint paths must be absolute, got {str(path)!r}")
        return path

    def check_savable(self, path: Path) -> None:
        path = self._absolute(path)
        if path.exists() and any(path.iterdir()):
            raise FailedPrecondition(
                f"{path} is not empty; choose a new directory for the checkpoint"
            )

    def check_loadable(self, path: Path) -> None:
        path = self._absolute(path)
        if not (path / STATE_FILE).is_file():
            raise FailedPrecondition(
                f"{path} holds no trainer checkpoint ({STATE_FILE} missing); "
                "pass a directory written by SaveCheckpoint"
            )

    def check_exportable(self, path: Path) -> None:
        path = self._absolute(path)
        if path.exists() and any(path.iterdir()):
            raise FailedPrecondition(f"{path} is not empty; choose a new directory for the export")

    def _sharded_state(self, engine: StepEngine, *, loading: bool) -> dict:
        model = engine.built.model
        model_state = model.sharded_state_dict()
        optimizer_state = engine.built.optimizer.sharded_state_dict(
            model_state, is_loading=loading, metadata=_METADATA
        )
        return {"model": model_state, "optimizer": optimizer_state}

    def save(self, path: Path, engine: StepEngine) -> SaveSummary:
        if engine.topology.is_leader:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier(group=engine.topology.control_group)
        with cpu_compat.active():
            state = self._sharded_state(engine, loading=False)
            dist_checkpointing.save(state, str(path), content_metadata=_METADATA)
        if engine.topology.is_leader:
            info = {
                "weights_version": engine.weights_version,
                "optimizer_step": engine.optimizer_step,
                "layout": engine.topology.layout.describe(),
            }
            (path / STATE_FILE).write_text(json.dumps(info, indent=2))
        dist.barrier(group=engine.topology.control_group)
        log.info("saved checkpoint %s at optimizer step %d", path, engine.optimizer_step)
        return SaveSummary(path, engine.weights_version, engine.optimizer_step)

    def load(self, path: Path, engine: StepEngine) -> None:
        info = json.loads((path / STATE_FILE).read_text())
        with cpu_compat.active(), torch.no_grad():
            state = self._sharded_state(engine, loading=True)
            loaded = dist_checkpointing.load(state, str(path))
            _restore_zero_step(loaded["optimizer"])
            engine.built.model.load_state_dict(loaded["model"])
            engine.built.optimizer.load_state_dict(loaded["optimizer"])
            _set_adam_steps(engine.built.optimizer, int(info["optimizer_step"]))
        engine.optimizer_step = int(info["optimizer_step"])
        log.info("loaded checkpoint %s (optimizer step %d)", path, engine.optimizer_step)

    def export_hf(self, path: Path, engine: StepEngine) -> ExportSummary | None:
        hf_state = gather_hf_state(engine.built.model, engine.spec, engine.topology)
        if hf_state is None:
            return None
        save_hf_checkpoint(path, hf_state, self.hf_source_dir)
        num_bytes = sum(t.numel() * t.element_size() for t in hf_state.values())
        log.info("exported %d tensors (%d bytes) to %s", len(hf_state), num_bytes, path)
        return ExportSummary(path, engine.weights_version, len(hf_state), num_bytes)
