"""The experts a vLLM engine routes each token to, for routing replay (R3) in the trainer.

vLLM's routers call a capture hook with each layer's top-k expert ids (logical ids, before any
expert-placement mapping) on every forward; vLLM's own capturer fills it only under its V2
model runner, which its CPU build lacks. A `RoutingCapture` binds the same hook on a worker's
model and keeps what the routers chose, layer by layer, until `take` hands it over as
``[tokens, layers, top_k]``: the rows of the forwards run since, in order. Run one request
at a time (`RefitEngine.probe_routing`) and those rows are its tokens, in the format vLLM's
``CompletionOutput.routed_experts`` reports and the trainer's ``routed_experts`` takes
(flattened to ``[tokens, layers * top_k]``). Layouts whose routers see other ranks' tokens
(data-parallel MoE) are refused.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch


class RoutingCapture:
    def __init__(self, model: torch.nn.Module) -> None:
        """Every MoE runner of `model` (a vLLM worker's), by its layer index."""
        self._runners: dict[int, Any] = {}
        for module in model.modules():
            runner: Any = module
            router = getattr(runner, "router", None)
            if router is not None and hasattr(router, "set_capture_fn"):
                self._runners[int(runner.layer_id)] = runner
        if not self._runners:
            raise ValueError("the engine's model has no mixture-of-experts layers to capture")
        self._layers = sorted(self._runners)
        self._rows: dict[int, list[torch.Tensor]] = {layer: [] for layer in self._layers}
        if any(getattr(r.moe_config, "dp_size", 1) > 1 for r in self._runners.values()):
            raise ValueError(
                "routing capture reads each layer's routing as this worker's tokens; a "
                "data-parallel MoE layer routes every data-parallel rank's tokens together"
            )
        for layer, runner in self._runners.items():
            runner.router.set_capture_fn(partial(self._capture, layer))

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        self._rows[layer].append(topk_ids.detach().to("cpu", torch.int64, copy=True))

    def take(self) -> np.ndarray:
        """``[tokens, layers, top_k]`` of the forwards since the last `take`, and forgets
        them; every layer must have seen the same tokens."""
        per_layer = [
            torch.cat(self._rows[layer]) if self._rows[layer] else None for layer in self._layers
        ]
        for layer in self._layers:
            self._rows[layer] = []
        if any(rows is None for rows in per_layer):
            raise ValueError("no forward ran through every layer since the last take")
        counts = {rows.shape[0] for rows in per_layer if rows is not None}
        if len(counts) != 1:
            raise ValueError(f"layers saw different token counts {sorted(counts)}")
        return torch.stack([r for r in per_layer if r is not None], dim=1).numpy()

    def close(self) -> None:
        for runner in self._runners.values():
            runner.router.set_capture_fn(None)
