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

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from inference_ext.receiver import Receiver, RefitError, RefitOptions
from inference_ext.slices import (
    ReceiverLayout,
    UnsupportedLayout,
    check_receiver_layout,
    vocab_rows,
)
from inference_ext.tied import refresh_tied_heads, tied_heads
from megatron_hf.convert import hf_names
from megatron_hf.spec import ModelSpec
from refit_sidecar.manifest import Box

log = logging.getLogger(__name__)

_STATE = "_refit_state"
_TIED = "_refit_tied_heads"


class RefitWorkerExtension:
    """Mixed into vLLM's worker class; public methods are the `refit_` calls only."""

    vllm_config: Any
    model_runner: Any
    reload_weights: Any

    def refit_init(self, sidecar: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Point this worker at a sidecar (replacing any earlier one); returns what it found
        out about itself."""
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        if self.vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise RefitError("refit supports vLLM engines with pipeline_parallel_size 1")
        opts = RefitOptions.from_dict(options)
        spec = ModelSpec.from_hf_config(self.vllm_config.model_config.hf_config)
        layout = ReceiverLayout(
            get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        )
        try:
            check_receiver_layout(spec, layout)
        except UnsupportedLayout as e:
            raise RefitError(str(e)) from None
        check_engine_layout(self.model_runner.model, spec, layout)
        self.refit_close()
        setattr(self, _TIED, tied_heads(self.model_runner.model))
        names = [n for n in hf_names(spec) if n != "lm_head.weight" or not spec.tie_word_embeddings]
        setattr(
            self,
            _STATE,
            Receiver(sidecar, spec, layout, names, options=opts, device=_device(self)),
        )
        log.info("refit: worker tp %d/%d reads from %s", layout.tp_rank, layout.tp_size, sidecar)
        return {"tp_rank": layout.tp_rank, "tp_size": layout.tp_size, "sidecar": sidecar}

    def refit_to(self, version: int | None = None) -> dict[str, Any]:
        """Switch to `version` (None: the latest). Returns this worker's stats with
        ``ok: True``, or ``ok: False`` and ``error`` when the engine stayed where it was.
        Always pulls: a restarted trainer may publish other weights under a number seen before."""
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
        receiver = self._refit_receiver()
        error = None
        if version is None:
            latest = receiver.latest_version() if group.rank_in_group == 0 else None
            version = group.broadcast_object(latest, src=0)
            if version is None:
                return {"ok": False, "error": "no version has been published yet"}
        try:
            receiver.fetch(version)
        except RefitError as e:
            error = str(e)
            log.warning("refit to version %d: %s", version, error)
        ready = torch.tensor([error is None], dtype=torch.int32)
        torch.distributed.all_reduce(
            ready, op=torch.distributed.ReduceOp.MIN, group=group.cpu_group
        )
        if not ready.item():
            return {
                "ok": False,
                "version": version,
                "error": error or "another worker of this engine could not fetch its slices",
            }

        def install(weights: Iterator[tuple[str, torch.Tensor]]) -> None:
            with torch.no_grad():
                self.reload_weights(weights_iterator=weights)
                refresh_tied_heads(getattr(self, _TIED, ()))

        stats = receiver.install(install)
        return {"ok": True, **stats.to_dict()}

    def refit_status(self) -> dict[str, Any]:
        receiver = getattr(self, _STATE, None)
        if receiver is None:
            return {"initialized": False, "installed_version": None}
        return {
            "initialized": True,
            "installed_version": receiver.installed_version,
            "tp_rank": receiver.layout.tp_rank,
            "tp_size": receiver.layout.tp_size,
        }

    def refit_slices(self, names: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
        """The HF-named slices this worker installed last, as raw bytes so they cross the
        RPC exactly: name -> {box, dtype, shape, data}; `engine.decode_slice` reads one."""
        slices = self._refit_receiver().slices(names)
        return {name: encode_slice(box, tensor) for name, (box, tensor) in slices.items()}

    def refit_close(self) -> None:
        receiver = getattr(self, _STATE, None)
        if receiver is not None:
            receiver.close()
            setattr(self, _STATE, None)

    def _refit_receiver(self) -> Receiver:
        receiver = getattr(self, _STATE, None)
        if receiver is not None:
            return receiver
        config = (self.vllm_config.additional_config or {}).get("refit") or {}
        if not config.get("sidecar"):
            raise RefitError(
                "refit is not initialised: call refit_init(sidecar) or start vLLM with "
                '--additional-config \'{"refit": {"sidecar": "HOST:PORT"}}\''
            )
        options = {k: v for k, v in config.items() if k not in ("sidecar", "auto")}
        self.refit_init(config["sidecar"], options)
        receiver = getattr(self, _STATE)
        assert receiver is not None
        return receiver


def encode_slice(box: Box, tensor: torch.Tensor) -> dict[str, Any]:
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    dtype = str(tensor.dtype).removeprefix("torch.")
    return {"box": box.ranges, "dtype": dtype, "shape": tuple(tensor.shape), "data": data}


def _device(worker: Any) -> torch.device:
    device = getattr(worker, "device", None)
    return device if isinstance(device, torch.device) else torch.device("cpu")


def check_engine_layout(model: torch.nn.Module, spec: ModelSpec, layout: ReceiverLayout) -> None:
    """Fail at `refit_init`, not with wrong weights later, when the engine's own sharding is
    not the one `slices` assumes: its vocabulary shard and its heads per rank."""
    problems = []
    for name, module in model.named_modules():
        indices = getattr(module, "shard_indices", None)
        if indices is not None:
            got = (indices.org_vocab_start_index, indices.org_vocab_end_index)
            if got != vocab_rows(spec, layout):
                problems.append(
                    f"{name} holds vocab rows {got}, expected {vocab_rows(spec, layout)}"
                )
        if type(module).__name__ == "QKVParallelLinear":
            heads = spec.num_attention_heads // layout.tp_size
            kv = max(spec.num_query_groups // layout.tp_size, 1)
            if (module.num_heads, module.num_kv_heads) != (heads, kv):
                problems.append(
                    f"{name} holds {module.num_heads} query / {module.num_kv_heads} kv heads, "
                    f"expected {heads} / {kv}"
                )
    if problems:
        raise RefitError("the engine's sharding differs from refit's: " + "; ".join(problems[:4]))
