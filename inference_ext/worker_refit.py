"""One vLLM worker's refit, whoever drives it: `RefitWorkerExtension` (``collective_rpc``, for
in-process engines) and the `trainer_refit` weight-transfer backend (vLLM's RL routes, for
``vllm serve``) both check the engine (`engine_layout`), build a `WorkerRefit` and run the same
steps on every worker of an engine:

1. `resolve`: "latest" becomes one number, asked of the sidecar by worker 0 and broadcast, so
   every worker pulls the same version;
2. `fetch`: each worker leases, pulls and verifies its own slices (`Receiver.fetch`), then the
   workers agree over vLLM's CPU process group, adding up the sums of the shards each read
   only part of (`group_check.py`); only if every one has its bytes and they add up does any
   of them go on;
3. `install`: the tensors go through vLLM's in-place layerwise reload (`reload` is the
   caller's: the worker's own ``reload_weights``, or vLLM's reload function for the backend),
   and the LM heads tied to the embedding rerun their post-load step (`tied.py`); a
   mixture of experts' fused expert tensors are installed after the reload, straight into
   vLLM's fused parameters (`fused_experts.py`).

A failure in 1 or 2 leaves the engine on the weights it serves, on every worker.

`prefetch` runs step 2's pull ahead, in a thread of the worker, while the engine keeps
generating: the receiver's staging memory is separate from the model's weights, so a later
`fetch` of the same version finds its bytes there and only agrees. Auto-refit
(`auto_refit.AutoRefit`) prefetches, waits for every worker's `prefetch_state`, then switches.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc
import torch

from inference_ext.expert_slices import receiver_names
from inference_ext.fused_experts import FusedExperts
from inference_ext.group_check import Agreement, agree
from inference_ext.receiver import Receiver
from inference_ext.refit_options import RefitError, RefitOptions, RefitStats
from inference_ext.slices import (
    ReceiverLayout,
    UnsupportedLayout,
    check_receiver_layout,
    vocab_rows,
)
from inference_ext.tied import refresh_tied_heads, tied_heads
from megatron_hf.convert import hf_names
from megatron_hf.spec import ModelSpec
from refit_sidecar.core.manifest import Box

log = logging.getLogger(__name__)

Reload = Callable[[Iterator[tuple[str, torch.Tensor]]], None]
"""Loads checkpoint-format (HF-named, full-shape) tensors into the engine's model in place."""

ANOTHER_WORKER_FAILED = "another worker of this engine could not fetch its slices"


@dataclass(frozen=True, kw_only=True)
class RefitTarget:
    """Where a worker's refit comes from: the sidecar's HOST:PORT and how to talk to it."""

    sidecar: str
    options: RefitOptions

    def __post_init__(self) -> None:
        if not isinstance(self.sidecar, str) or not self.sidecar:
            raise ValueError(f"sidecar must be the sidecar's HOST:PORT, got {self.sidecar!r}")
        if not isinstance(self.options, RefitOptions):
            raise ValueError(f"options must be RefitOptions, got {type(self.options).__name__}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> RefitTarget:
        """``{"sidecar": "HOST:PORT", **RefitOptions fields}`` (the JSON form)."""
        values = dict(values)
        if "sidecar" not in values:
            raise ValueError(f'the sidecar address ("sidecar": "HOST:PORT") is missing: {values}')
        sidecar = values.pop("sidecar")
        return cls(sidecar=sidecar, options=RefitOptions.from_dict(values))


def additional_config_target(vllm_config: Any) -> RefitTarget | None:
    """The target in the engine's ``--additional-config '{"refit": {"sidecar": ...}}'``, if
    any. Keys for later features (``auto``) are not options of a single refit."""
    config = (vllm_config.additional_config or {}).get("refit") or {}
    if not config.get("sidecar"):
        return None
    return RefitTarget.from_dict({k: v for k, v in config.items() if k != "auto"})


class Prefetch:
    """One background pull of a version into the receiver's staging memory."""

    def __init__(self, receiver: Receiver, version: int) -> None:
        self.version = version
        self.error: str | None = None
        self._thread = threading.Thread(
            target=self._run, args=(receiver,), name=f"refit-prefetch-{version}", daemon=True
        )
        self._thread.start()

    def _run(self, receiver: Receiver) -> None:
        try:
            # Prefetches follow announced versions: one that is not readable (any more) fails
            # at once instead of being waited for.
            receiver.fetch(self.version, visible_timeout_s=0)
        except RefitError as e:
            self.error = str(e)
        except Exception as e:  # the thread must report, not die silently
            self.error = f"prefetching version {self.version} failed: {_describe(e)}"
        if self.error is not None:
            log.warning("refit: prefetch of version %d: %s", self.version, self.error)

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> str | None:
        """Block until the pull ends; its error, None when the bytes are staged."""
        self._thread.join()
        return self.error

    def state(self) -> dict[str, Any]:
        if not self.done:
            return {"version": self.version, "state": "pending"}
        if self.error is not None:
            return {"version": self.version, "state": "failed", "error": self.error}
        return {"version": self.version, "state": "ready"}


class WorkerRefit:
    """The refit state of one vLLM worker: its receiver, the tied heads of its model and its
    fused expert layers (a mixture of experts)."""

    def __init__(
        self,
        receiver: Receiver,
        tied: list[torch.nn.Module],
        experts: FusedExperts | None = None,
    ) -> None:
        self.receiver = receiver
        self.tied = tied
        self.experts = experts
        self._prefetch: Prefetch | None = None
        """The last background pull, until a `fetch` or `close` settles it."""
        self._asking: threading.Thread | None = None
        """`expect`'s call in progress, until anything else settles it."""
        self._agreed = Agreement(False)
        """The workers' agreement on the last `fetch`."""

    @classmethod
    def build(
        cls,
        target: RefitTarget,
        engine: EngineLayout,
        model: torch.nn.Module,
        device: torch.device,
    ) -> WorkerRefit:
        """The worker's receiver (its NIXL agent and sidecar client) for a checked engine."""
        spec, layout = engine.spec, engine.layout
        names = [n for n in hf_names(spec) if n != "lm_head.weight" or not spec.tie_word_embeddings]
        experts = FusedExperts.find(model, spec, layout) if spec.moe is not None else None
        receiver = Receiver(
            target.sidecar,
            spec,
            layout,
            receiver_names(spec, names),
            options=target.options,
            device=device,
        )
        log.info(
            "refit: worker tp %d/%d reads from %s", layout.tp_rank, layout.tp_size, target.sidecar
        )
        return cls(receiver, tied_heads(model), experts)

    @property
    def layout(self) -> ReceiverLayout:
        return self.receiver.layout

    @property
    def installed_version(self) -> int | None:
        return self.receiver.installed_version

    def resolve(self, version: int | None) -> int | None:
        """`version`, or for None the sidecar's latest (None when nothing is published), the
        same on every worker. RefitError on every worker when the sidecar cannot be asked."""
        if version is not None:
            return version
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
        answer: tuple[int | None, str | None] = (None, None)
        if group.rank_in_group == 0:
            try:
                answer = (self.receiver.latest_version(), None)
            except Exception as e:
                answer = (None, f"cannot ask the sidecar for the latest version: {_describe(e)}")
        latest, error = group.broadcast_object(answer, src=0)
        if error is not None:
            raise RefitError(error)
        return latest

    def prefetch(self, version: int) -> dict[str, Any]:
        """Start pulling `version` into staging in the background and return at once (its
        `prefetch_state`). A pull of the same version that is running or staged is kept; one
        of another version is waited for first (the receiver pulls one version at a time)."""
        current = self._prefetch
        if current is not None and current.version == version and current.error is None:
            return current.state()
        self._settle()
        self._prefetch = Prefetch(self.receiver, version)
        return self._prefetch.state()

    def expect(self, version: int) -> dict[str, Any]:
        """Ask the sidecar ahead for `version` (`Receiver.expect`) in a thread, so the engine's
        step loop never waits on the sidecar; nothing when a pull is running (the receiver is
        its thread's until it ends). The next prefetch, fetch or close waits for the asking."""
        current = self._prefetch
        if current is not None and not current.done:
            return {"version": version, "asking": False}
        self._settle()
        self._asking = threading.Thread(
            target=self._expect, args=(version,), name=f"refit-expect-{version}", daemon=True
        )
        self._asking.start()
        return {"version": version, "asking": True}

    def _expect(self, version: int) -> None:
        try:
            self.receiver.expect(version)
        except Exception as e:  # an optimisation only: the fetch asks as before
            log.warning("refit: asking ahead for version %d failed: %s", version, _describe(e))

    def prefetch_state(self, version: int) -> dict[str, Any]:
        """``{"version", "state": "pending" | "ready" | "failed" | "none", "error"?}`` of the
        background pull of `version` ("none": no such pull)."""
        current = self._prefetch
        if current is None or current.version != version:
            return {"version": version, "state": "none"}
        return current.state()

    def _settle(self) -> Prefetch | None:
        """Wait for a background pull (or asking), and forget it: the receiver is this
        thread's again."""
        asking, self._asking = self._asking, None
        if asking is not None:
            asking.join()
        current, self._prefetch = self._prefetch, None
        if current is not None:
            current.wait()
        return current

    def fetch(self, version: int) -> str | None:
        """Pull and verify this worker's slices of `version` (or take those a `prefetch` of it
        staged), then agree with the other workers, checking together the shards each read
        part of (`group_check.agree`); None when every worker has its bytes and they add up,
        else why not (this worker's error, `ANOTHER_WORKER_FAILED`, or the shard whose parts'
        WSUM-64 differs, the same words on every worker)."""
        from vllm.distributed.parallel_state import get_world_group

        error = None
        prefetched = self._settle()
        staged = prefetched is not None and prefetched.version == version and not prefetched.error
        if not staged:
            try:
                self.receiver.fetch(version)
            except RefitError as e:
                error = str(e)
                log.warning("refit to version %d: %s", version, error)
        partial = None if error is not None else self.receiver.partial_sums()
        self._agreed = agree(error is None, partial, get_world_group().cpu_group)
        if not self._agreed.ready:
            return error or ANOTHER_WORKER_FAILED
        if self._agreed.error is not None:
            self.receiver.abandon()  # every worker refuses: nothing of the version installs
            log.warning("refit to version %d: %s", version, self._agreed.error)
            return self._agreed.error
        return None

    def install(self, reload: Reload) -> RefitStats:
        """Hand the fetched version to `reload` (and the experts to their fused parameters),
        then refresh the tied LM heads."""
        experts = self.experts

        def installer(weights: Iterator[tuple[str, torch.Tensor]]) -> None:
            with torch.no_grad():
                if experts is None:
                    reload(weights)
                else:
                    experts.install(weights, reload)
                refresh_tied_heads(self.tied)

        stats = self.receiver.install(installer)  # `fetch` settled any background pull
        agreed = self._agreed
        return replace(
            stats,
            group_verified_shards=agreed.verified_shards,
            unverified_bytes=stats.unverified_bytes - agreed.verified_bytes,
        )

    def slices(self, names: Sequence[str] | None) -> dict[str, tuple[Box, torch.Tensor]]:
        """The installed version's slices as staging holds them (see `Receiver.slices`)."""
        self._settle()
        return self.receiver.slices(names)

    def close(self) -> None:
        self._settle()
        self.receiver.close()


@dataclass(frozen=True)
class EngineLayout:
    """The model a worker serves and the worker's place in its engine."""

    spec: ModelSpec
    layout: ReceiverLayout


def engine_layout(vllm_config: Any, model: torch.nn.Module) -> EngineLayout:
    """This worker's model and TP rank, once checked that refit can serve them: no pipeline
    parallelism, and a model its TP splits the way `slices` assumes. RefitError otherwise."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise RefitError("refit supports vLLM engines with pipeline_parallel_size 1")
    spec = ModelSpec.from_hf_config(vllm_config.model_config.hf_config)
    if spec.moe is not None and parallel.data_parallel_size != 1:
        raise RefitError(
            "refit of a mixture-of-experts engine supports data_parallel_size 1 (vLLM spreads "
            f"experts over its data-parallel ranks too), got {parallel.data_parallel_size}"
        )
    layout = ReceiverLayout(
        get_tensor_model_parallel_rank(),
        get_tensor_model_parallel_world_size(),
        expert_parallel=spec.moe is not None and bool(parallel.enable_expert_parallel),
    )
    try:
        check_receiver_layout(spec, layout)
    except UnsupportedLayout as e:
        raise RefitError(str(e)) from None
    check_engine_layout(model, spec, layout)
    return EngineLayout(spec, layout)


def _describe(error: Exception) -> str:
    """One line: a gRPC error's status and details, else the exception's text."""
    if isinstance(error, grpc.RpcError) and isinstance(error, grpc.Call):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"


def check_engine_layout(model: torch.nn.Module, spec: ModelSpec, layout: ReceiverLayout) -> None:
    """Fail at initialisation, not with wrong weights later, when the engine's own sharding
    is not the one `slices` assumes: its vocabulary shard and its heads per rank."""
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
