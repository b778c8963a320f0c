"""The experts a vLLM engine routes each request's tokens to, for routing replay (R3).

vLLM's routers call a capture hook with each layer's top-k expert ids (logical ids, before any
expert-placement mapping) on every forward; vLLM's own capturer fills it only under its V2
model runner, which its CPU build lacks. A `RoutingCapture` binds the same hook on a worker's
model, and wraps its model runner's `execute_model` so that after each forward the rows it
kept are dealt to the requests of the batch, in the batch's order (each request's scheduled
tokens are contiguous there). `take` hands each request's routing over as
``[tokens, layers, top_k]``: the tokens it ran through the model, in order, which for a
finished request are its prompt and every sampled token but the last. That is the format of
vLLM's ``CompletionOutput.routed_experts`` and what the trainer's ``routed_experts`` takes
(flattened to ``[tokens, layers * top_k]``, a row for the sequence's last token added).

A prompt token served from the prefix cache runs no forward and has no routing: run the
engine with prefix caching off while capturing. Layouts whose routers see other ranks' tokens
(data-parallel MoE) are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import numpy as np
import torch


class RoutingCapture:
    def __init__(self, runner: Any) -> None:
        """Binds to every MoE layer of a vLLM worker's model runner (`runner.model`)."""
        self._runner = runner
        self._layers_by_id: dict[int, Any] = {}
        for module in runner.model.modules():
            moe: Any = module
            router = getattr(moe, "router", None)
            if router is not None and hasattr(router, "set_capture_fn"):
                self._layers_by_id[int(moe.layer_id)] = moe
        if not self._layers_by_id:
            raise ValueError("the engine's model has no mixture-of-experts layers to capture")
        if any(getattr(m.moe_config, "dp_size", 1) > 1 for m in self._layers_by_id.values()):
            raise ValueError(
                "routing capture reads each layer's routing as this worker's tokens; a "
                "data-parallel MoE layer routes every data-parallel rank's tokens together"
            )
        self._layers = sorted(self._layers_by_id)
        self._step: dict[int, list[torch.Tensor]] = {layer: [] for layer in self._layers}
        self._requests: dict[str, list[np.ndarray]] = {}
        for layer, moe in self._layers_by_id.items():
            moe.router.set_capture_fn(partial(self._capture, layer))
        self._execute = runner.execute_model
        runner.execute_model = self._execute_model

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        self._step[layer].append(topk_ids.detach().to("cpu", torch.int64, copy=True))

    def _execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._execute(scheduler_output, *args, **kwargs)
        finally:
            self._deal(scheduler_output)

    def _deal(self, scheduler_output: Any) -> None:
        """The forward's rows to its requests, in the runner's batch order."""
        rows = [
            torch.cat(self._step[layer]) if self._step[layer] else None for layer in self._layers
        ]
        for layer in self._layers:
            self._step[layer] = []
        scheduled: Mapping[str, int] = scheduler_output.num_scheduled_tokens
        if not scheduled or any(r is None for r in rows):
            return  # no forward ran (an empty step), or it was not this model's
        batch = self._runner.input_batch
        order = [r for r in batch.req_ids[: batch.num_reqs] if r in scheduled]
        counts = [int(scheduled[r]) for r in order]
        step = torch.stack([r for r in rows if r is not None], dim=1).numpy()
        if step.shape[0] < sum(counts):
            raise RuntimeError(
                f"the routers saw {step.shape[0]} tokens of a batch of {sum(counts)}"
            )
        at = 0
        for request, count in zip(order, counts, strict=True):
            self._requests.setdefault(request, []).append(step[at : at + count])
            at += count

    def take(self) -> dict[str, np.ndarray]:
        """Each request's ``[tokens, layers, top_k]`` since the last `take`, by vLLM's
        internal request id; forgets them."""
        taken = {r: np.concatenate(parts) for r, parts in self._requests.items()}
        self._requests = {}
        return taken

    def close(self) -> None:
        for moe in self._layers_by_id.values():
            moe.router.set_capture_fn(None)
        self._runner.execute_model = self._execute


def request_routing(
    taken: Mapping[str, np.ndarray], request_id: str, index: int, samples: int
) -> np.ndarray:
    """The routing of sample `index` of the request vLLM's `LLM.generate` answered as
    `request_id`: the engine names a request of `samples` > 1 samples' children
    ``{index}_{request_id}-{suffix}``, a single sample ``{request_id}-{suffix}``."""
    prefix = f"{index}_{request_id}-" if samples > 1 else f"{request_id}-"
    found = [routing for name, routing in taken.items() if name.startswith(prefix)]
    if len(found) != 1:
        raise KeyError(f"{len(found)} captured requests for sample {index} of request {request_id}")
    return found[0]
