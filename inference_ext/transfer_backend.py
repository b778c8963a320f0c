"""`trainer_refit`: a vLLM weight-transfer backend that pulls the trainer's published versions,
so a ``vllm serve`` replica (or an ``LLM``) refits through vLLM's own RL API.

Start vLLM with ``--weight-transfer-config '{"backend": "trainer_refit"}'`` (the package's
``vllm.general_plugins`` entry point registers the name, see `plugin.py`), then:

- ``init_weight_transfer_engine`` with ``{"sidecar": "HOST:PORT", **RefitOptions fields}``
  (`parse_init_info`): every worker checks the engine and builds its receiver;
- ``update_weights`` with ``{"version": N}`` or ``{"version": "latest"}``
  (`parse_update_info`): every worker resolves, pulls, verifies, agrees and installs, the same
  `WorkerRefit` steps `RefitWorkerExtension` runs, or raises `RefitError` with the engine on
  its old weights on every worker;
- ``start_weight_update`` and ``finish_weight_update`` bracket it; the version's bytes are
  installed, tied LM heads included, by the time ``update_weights`` returns.

Without an ``init_weight_transfer_engine`` call, the first update reads the sidecar and options
from ``--additional-config '{"refit": {...}}'``, as the worker extension does; an engine started
with that section refuses other settings (`check_init`). vLLM's weight version (/weight_info)
lives in its engine core, out of a worker's reach: the caller sets it at
``finish_weight_update``. docs/inference.md has the whole sequence.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from inference_ext.plugin import BACKEND
from inference_ext.refit_options import RefitError
from inference_ext.worker_refit import (
    RefitTarget,
    WorkerRefit,
    additional_config_target,
    engine_layout,
)

log = logging.getLogger(__name__)

LATEST = "latest"


# vLLM's base info classes are mutable dataclasses, so these cannot be frozen; nothing
# changes them after validation.
@dataclass(kw_only=True)
class TrainerRefitInitInfo(WeightTransferInitInfo):
    """Where every worker of the engine pulls from, and how."""

    target: RefitTarget

    def __post_init__(self) -> None:
        if not isinstance(self.target, RefitTarget):
            raise ValueError(f"target must be a RefitTarget, got {type(self.target).__name__}")


@dataclass(kw_only=True)
class TrainerRefitUpdateInfo(WeightTransferUpdateInfo):
    """The version to switch to: a number FinishTrainStep returned, or the latest one."""

    version: int | Literal["latest"]

    def __post_init__(self) -> None:
        version = self.version
        number = isinstance(version, int) and not isinstance(version, bool) and version >= 1
        if not number and version != LATEST:
            raise ValueError(
                f'version must be a weights version (an integer >= 1) or "latest", '
                f"got {self.version!r}"
            )

    @property
    def wanted(self) -> int | None:
        """The version number, None for the latest."""
        return None if self.version == LATEST else int(self.version)


def parse_init_info(values: Mapping[str, Any]) -> TrainerRefitInitInfo:
    """``{"sidecar": "HOST:PORT", "token_file": ..., ...}``: the sidecar address and the
    `RefitOptions` fields, flat (the form of ``--additional-config``'s ``refit`` section)."""
    if not isinstance(values, Mapping):
        raise ValueError(f"init_info must be a JSON object, got {values!r}")
    return TrainerRefitInitInfo(target=RefitTarget.from_dict(values))


def parse_update_info(values: Mapping[str, Any]) -> TrainerRefitUpdateInfo:
    """``{"version": N}`` or ``{"version": "latest"}``."""
    if not isinstance(values, Mapping):
        raise ValueError(f"update_info must be a JSON object, got {values!r}")
    unknown = sorted(set(values) - {"version"})
    if unknown or "version" not in values:
        raise ValueError(f'update_info must be {{"version": N or "latest"}}, got {dict(values)!r}')
    return TrainerRefitUpdateInfo(version=values["version"])


def check_init(pinned: RefitTarget | None, requested: RefitTarget) -> None:
    """An engine started with a ``refit`` section in ``--additional-config`` reads from that
    sidecar with those credentials only: vLLM's RL routes carry no authentication, and an
    init naming another address would send the token file's contents there."""
    if pinned is not None and requested != pinned:
        raise RefitError(
            "this engine's refit settings are fixed by its --additional-config "
            f"(sidecar {pinned.sidecar}); init_info may repeat them, not change them"
        )


class TrainerRefitEngine(WeightTransferEngine[TrainerRefitInitInfo, TrainerRefitUpdateInfo]):
    """One worker's side of the backend; vLLM builds it after loading the model and calls it
    on every worker of the engine at once."""

    init_info_cls = TrainerRefitInitInfo
    update_info_cls = TrainerRefitUpdateInfo
    supports_draft_weight_update = False
    """Versions carry the trained model only."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._refit: WorkerRefit | None = None
        self.installed_version: int | None = None
        """The version this worker installed last (None: the weights it started with)."""

    def parse_init_info(self, init_dict: dict[str, Any]) -> TrainerRefitInitInfo:
        return parse_init_info(init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> TrainerRefitUpdateInfo:
        return parse_update_info(update_dict)

    def init_transfer_engine(self, init_info: TrainerRefitInitInfo) -> None:
        """Check the engine and (re)build this worker's receiver; an earlier one is closed,
        the installed weights stay."""
        check_init(additional_config_target(self.vllm_config), init_info.target)
        self._init(init_info.target)

    def _init(self, target: RefitTarget) -> WorkerRefit:
        engine = engine_layout(self.vllm_config, self.model)
        self.shutdown()
        self._refit = WorkerRefit.build(target, engine, self.model, self.device)
        return self._refit

    def _worker_refit(self) -> WorkerRefit:
        if self._refit is not None:
            return self._refit
        target = additional_config_target(self.vllm_config)
        if target is None:
            raise RefitError(
                f"the {BACKEND} weight transfer is not initialised: call "
                '/init_weight_transfer_engine with {"init_info": {"sidecar": "HOST:PORT", '
                '"token_file": ...}} first, or start vLLM with '
                '--additional-config \'{"refit": {"sidecar": "HOST:PORT", ...}}\''
            )
        return self._init(target)

    def start_weight_update(self) -> None:
        """Nothing to prepare (the update installs whole versions), but an engine that
        cannot update says so here."""
        self._worker_refit()

    def receive_weights(self, update_info: TrainerRefitUpdateInfo) -> None:
        refit = self._worker_refit()
        try:
            version = refit.resolve(update_info.wanted)
        except RefitError as e:
            raise self._failed("the latest version", str(e)) from None
        if version is None:
            raise self._failed("the latest version", "no version has been published yet")
        error = refit.fetch(version)
        if error is not None:
            raise self._failed(f"version {version}", error)
        stats = refit.install(self._reload)
        self.installed_version = stats.version
        log.info(
            "refit: worker tp %d installed version %d (%d bytes, %.3f s pull, %.3f s install)",
            stats.tp_rank,
            stats.version,
            stats.bytes_pulled,
            stats.pull_s,
            stats.install_s,
        )

    def _failed(self, wanted: str, cause: str) -> RefitError:
        served = self.installed_version
        return RefitError(
            f"refit to {wanted} failed, the engine still serves "
            f"{'its initial weights' if served is None else f'version {served}'}: {cause}"
        )

    def _reload(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """vLLM's in-place layerwise reload, as the worker's ``reload_weights`` runs it; the
        worker resets its LoRA state at ``finish_weight_update``."""
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        reload_weights(
            self.vllm_config,
            self.model,
            weights_iterator=weights,
            weights_path=None,
            is_checkpoint_format=True,
        )

    def finish_weight_update(self) -> None:
        """Nothing to finish: `receive_weights` installed the version whole."""

    def shutdown(self) -> None:
        if self._refit is not None:
            self._refit.close()
            self._refit = None
