"""`RefitWorkerExtension`: the vLLM worker mixin (``worker_extension_cls``) that refits a
running engine from the trainer's published versions.

Every method is called on all of an engine's workers at once through ``collective_rpc``.
`refit_to` is atomic per engine: each worker pulls and verifies its own slices, the workers
agree over vLLM's CPU process group, and only if every one of them has its bytes does any of
them install, through vLLM's in-place layerwise reload. Otherwise all keep the version they
serve and every worker reports the failure.

The sidecar address comes from `refit_init`, or else from the engine's
``--additional-config '{"refit": {"sidecar": "HOST:PORT", ...}}'`` on first use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from inference_ext.refit_options import RefitError, RefitOptions
from inference_ext.routing_capture import RoutingCapture
from inference_ext.worker_refit import (
    RefitTarget,
    WorkerRefit,
    additional_config_target,
    engine_layout,
)
from refit_sidecar.core.manifest import Box

_STATE = "_refit_state"
_CAPTURE = "_refit_routing_capture"


class RefitWorkerExtension:
    """Mixed into vLLM's worker class; public methods are the `refit_` calls only."""

    vllm_config: Any
    model_runner: Any
    reload_weights: Any

    def refit_init(self, sidecar: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Point this worker at a sidecar (replacing any earlier one); returns what it found
        out about itself."""
        target = RefitTarget(sidecar=sidecar, options=RefitOptions.from_dict(options))
        return self._refit_init(target)

    def _refit_init(self, target: RefitTarget) -> dict[str, Any]:
        model = self.model_runner.model
        engine = engine_layout(self.vllm_config, model)
        self.refit_close()
        setattr(self, _STATE, WorkerRefit.build(target, engine, model, _device(self)))
        layout = engine.layout
        return {"tp_rank": layout.tp_rank, "tp_size": layout.tp_size, "sidecar": target.sidecar}

    def refit_to(self, version: int | None = None) -> dict[str, Any]:
        """Switch to `version` (None: the latest). Returns this worker's stats with
        ``ok: True``, or ``ok: False`` and ``error`` when the engine stayed where it was.
        Always pulls: a restarted trainer may publish other weights under a number seen before."""
        refit = self._refit()
        try:
            resolved = refit.resolve(version)  # the same outcome on every worker
        except RefitError as e:
            return {"ok": False, "error": str(e)}
        if resolved is None:
            return {"ok": False, "error": "no version has been published yet"}
        error = refit.fetch(resolved)
        if error is not None:
            return {"ok": False, "version": resolved, "error": error}

        def reload(weights: Iterator[tuple[str, torch.Tensor]]) -> None:
            self.reload_weights(weights_iterator=weights)

        stats = refit.install(reload)
        return {"ok": True, **stats.to_dict()}

    def refit_prefetch(self, version: int) -> dict[str, Any]:
        """Start pulling `version`'s slices in the background and return at once; the engine
        keeps generating on its weights. A later ``refit_to(version)`` installs the staged
        bytes. Returns `refit_prefetch_state`; never raises (see `_never_raises`)."""
        return self._never_raises(version, lambda refit: refit.prefetch(version))

    def refit_expect(self, version: int) -> dict[str, Any]:
        """Ask the sidecar now for `version`, to be answered the moment it is published
        (`Receiver.expect`): the prefetch or refit of it that follows starts reading at once.
        Returns ``asking``; never raises (see `_never_raises`)."""
        return self._never_raises(version, lambda refit: refit.expect(version))

    def refit_prefetch_state(self, version: int) -> dict[str, Any]:
        """This worker's background pull of `version`: ``state`` is "pending", "ready",
        "failed" (with ``error``) or "none"."""
        return self._never_raises(version, lambda refit: refit.prefetch_state(version))

    def _never_raises(
        self, version: int, call: Callable[[WorkerRefit], dict[str, Any]]
    ) -> dict[str, Any]:
        """`call`'s state, or a failed state naming the error. vLLM 0.32's multiprocess
        executor reads the workers' replies in rank order and stops at the first error, so the
        other workers' replies would answer the engine's next calls: a call that can fail on
        a worker of a TP>1 engine reports its failure in its result instead."""
        tp_rank = self.vllm_config.parallel_config.rank
        try:
            refit = self._refit()
            return {"tp_rank": refit.layout.tp_rank, **call(refit)}
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            return {"tp_rank": tp_rank, "version": version, "state": "failed", "error": error}

    def refit_status(self) -> dict[str, Any]:
        refit: WorkerRefit | None = getattr(self, _STATE, None)
        if refit is None:
            return {"initialized": False, "installed_version": None}
        return {
            "initialized": True,
            "installed_version": refit.installed_version,
            "tp_rank": refit.layout.tp_rank,
            "tp_size": refit.layout.tp_size,
        }

    def refit_slices(self, names: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
        """The HF-named slices this worker installed last, as raw bytes so they cross the
        RPC exactly: name -> {box, dtype, shape, data}; `engine.decode_slice` reads one."""
        slices = self._refit().slices(names)
        return {name: encode_slice(box, tensor) for name, (box, tensor) in slices.items()}

    def refit_capture_routing(self, enable: bool) -> None:
        """Start (or stop) keeping each MoE layer's routing of the forwards to come
        (`routing_capture`)."""
        capture: RoutingCapture | None = getattr(self, _CAPTURE, None)
        if capture is not None:
            capture.close()
            setattr(self, _CAPTURE, None)
        if enable:
            setattr(self, _CAPTURE, RoutingCapture(self.model_runner.model))

    def refit_routed_experts(self) -> dict[str, Any]:
        """The routing kept since the last call, ``[tokens, layers, top_k]`` int64, as raw
        bytes: {shape, data}."""
        capture: RoutingCapture | None = getattr(self, _CAPTURE, None)
        if capture is None:
            raise RefitError("routing capture is off: call refit_capture_routing(True) first")
        routed = capture.take()
        return {"shape": list(routed.shape), "data": routed.tobytes()}

    def refit_close(self) -> None:
        refit: WorkerRefit | None = getattr(self, _STATE, None)
        if refit is not None:
            refit.close()
            setattr(self, _STATE, None)

    def _refit(self) -> WorkerRefit:
        refit: WorkerRefit | None = getattr(self, _STATE, None)
        if refit is not None:
            return refit
        target = additional_config_target(self.vllm_config)
        if target is None:
            raise RefitError(
                "refit is not initialised: call refit_init(sidecar) or start vLLM with "
                '--additional-config \'{"refit": {"sidecar": "HOST:PORT"}}\''
            )
        self._refit_init(target)
        refit = getattr(self, _STATE)
        assert refit is not None
        return refit


def encode_slice(box: Box, tensor: torch.Tensor) -> dict[str, Any]:
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    dtype = str(tensor.dtype).removeprefix("torch.")
    return {"box": box.ranges, "dtype": dtype, "shape": tuple(tensor.shape), "data": data}


def _device(worker: Any) -> torch.device:
    device = getattr(worker, "device", None)
    return device if isinstance(device, torch.device) else torch.device("cpu")
