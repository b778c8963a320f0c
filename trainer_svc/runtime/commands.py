"""Commands that rank 0 broadcasts to every rank; each rank applies them in the same order."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_hf.export_plan import DEFAULT_FILE_BYTES
from trainer_svc.domain import (
    ExportDType,
    ForwardOutput,
    LossConfig,
    OptimizerOverrides,
    SequenceBatch,
    StalenessBound,
)


@dataclass(frozen=True)
class BeginStep:
    step_id: str
    loss: LossConfig
    optimizer: OptimizerOverrides
    staleness: StalenessBound | None = None


@dataclass(frozen=True)
class TrainMicrobatch:
    step_id: str
    request_id: str
    batch: SequenceBatch


@dataclass(frozen=True)
class Reservation:
    """A refit snapshot slot reserved by rank 0 for a new version, in the sidecar
    registration (`generation`) every rank's report of it presents."""

    slot: int
    generation: int


@dataclass(frozen=True)
class FinishStep:
    step_id: str
    wait_for_update: bool = False
    """Answer once the update is applied on the device, not once it is queued."""
    slot: Reservation | None = None
    """Refit snapshot slot for the new version, reserved by rank 0 before the broadcast."""


@dataclass(frozen=True)
class AbortStep:
    step_id: str


@dataclass(frozen=True)
class RunForward:
    batch: SequenceBatch
    outputs: frozenset[ForwardOutput]
    top_k: int = 0


@dataclass(frozen=True)
class SaveCheckpoint:
    path: Path


@dataclass(frozen=True)
class LoadCheckpoint:
    path: Path
    slot: Reservation | None = None
    """Refit snapshot slot for the loaded weights' version, reserved like FinishStep's."""


@dataclass(frozen=True)
class ExportHF:
    path: Path
    dtype: ExportDType = ExportDType.BFLOAT16
    max_file_bytes: int = DEFAULT_FILE_BYTES


@dataclass(frozen=True)
class PublishStart:
    """The weights the trainer started with, published as its first version
    (`RefitConfig.publish_start`): receivers started before the first step have a version to
    install, and their first refit's set-up is behind them when the steps come."""

    slot: Reservation | None = None


@dataclass(frozen=True)
class SetReference:
    """Make the current weights the reference policy's."""


@dataclass(frozen=True)
class Shutdown:
    pass


Command = (
    BeginStep
    | TrainMicrobatch
    | FinishStep
    | AbortStep
    | RunForward
    | SaveCheckpoint
    | LoadCheckpoint
    | ExportHF
    | PublishStart
    | SetReference
    | Shutdown
)
