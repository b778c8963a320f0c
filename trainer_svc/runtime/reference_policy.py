"""A frozen copy of the weights the service started with (or of those current when the client
last called SetReference), for the KL term's reference logprobs, computed inside
TrainMicrobatch instead of by the client on another engine.

The copy is of this rank's own parameters (sharded like the model: its TP and PP slices), in
their dtype: one more copy of the rank's weights in device memory. To score a pass the
reference weights are swapped into the model's parameters (one multi-tensor copy in, the
current weights kept aside in a scratch of the same size, one copy back), the pass runs
forward only, and the trained weights return before the training forward of the same pass.
Megatron's model code is used unchanged, so the reference logprobs are exactly what a Forward
at the initial weights gives. The scratch is allocated once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainer_svc.runtime.model_runner import ModelRunner
from trainer_svc.runtime.packing import PackedBatch


class ReferencePolicy:
    def __init__(self, model: torch.nn.Module) -> None:
        self._params = [p for p in model.parameters()]
        with torch.no_grad():
            self._weights = [p.detach().clone() for p in self._params]
        self._scratch = [torch.empty_like(w) for w in self._weights]

    @torch.no_grad()
    def capture(self) -> None:
        """Makes the model's current weights the reference."""
        torch._foreach_copy_(self._weights, [p.data for p in self._params])

    @property
    def nbytes(self) -> int:
        """Device memory the reference holds (its weights and the scratch)."""
        return 2 * sum(w.numel() * w.element_size() for w in self._weights)

    @torch.no_grad()
    def logprobs(
        self,
        runner: ModelRunner,
        packed: PackedBatch,
        score: Callable[[PackedBatch, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor | None:
        """The targets' logprobs under the reference weights, ``[rows, width]``, on the last
        pipeline stage (None elsewhere). `score` turns a pass's logits into them."""

        def loss_function(batch: PackedBatch, logits: torch.Tensor) -> Any:
            logprobs = score(batch, logits)
            return logprobs.sum() * 0.0, torch.tensor(0, dtype=torch.int), {"lp": logprobs}

        current = [p.data for p in self._params]
        torch._foreach_copy_(self._scratch, current)
        torch._foreach_copy_(current, self._weights)
        try:
            outputs = runner.run(packed, loss_function, forward_only=True)
        finally:
            torch._foreach_copy_(current, self._scratch)
        return outputs[0]["lp"] if outputs else None
