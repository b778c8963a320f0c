"""A frozen copy of the weights the service started with (or of those current when the client
last called SetReference), for the KL term's reference logprobs, computed inside
TrainMicrobatch instead of by the client on another engine.

The copy is of this rank's own parameters (sharded like the model: its TP and PP slices), in
their dtype. To score a pass the reference weights are swapped into the model's parameters
(the current weights kept aside in a scratch of the same size, the reference copied in, the
current weights copied back after), the pass runs forward only, and the trained weights return
before the training forward of the same pass. Megatron's model code is used unchanged, so the
reference logprobs are exactly what a Forward at the initial weights gives. The copy and the
scratch are allocated once, beside the model or in pinned host memory (`ReferencePlacement`):
on the device they cost twice the rank's weights, on the host none of its memory but three
host-device copies per pass, queued on the compute stream like the pass itself (pinned memory,
so no copy waits for the host).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainer_svc.config import ReferencePlacement
from trainer_svc.runtime.model_runner import ModelRunner
from trainer_svc.runtime.packing import PackedBatch


class ReferencePolicy:
    def __init__(
        self, model: torch.nn.Module, placement: ReferencePlacement = ReferencePlacement.DEVICE
    ) -> None:
        self._params = [p for p in model.parameters()]
        self._weights = [self._allocate(p, placement) for p in self._params]
        self._scratch = [self._allocate(p, placement) for p in self._params]
        self.capture()

    @staticmethod
    def _allocate(parameter: torch.Tensor, placement: ReferencePlacement) -> torch.Tensor:
        if placement is ReferencePlacement.DEVICE or parameter.device.type == "cpu":
            return torch.empty_like(parameter, requires_grad=False)
        return torch.empty(parameter.shape, dtype=parameter.dtype, device="cpu", pin_memory=True)

    @torch.no_grad()
    def capture(self) -> None:
        """Makes the model's current weights the reference."""
        _copy(self._weights, [p.data for p in self._params])

    @property
    def nbytes(self) -> int:
        """Memory the reference holds (its weights and the scratch), where it is placed."""
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
        _copy(self._scratch, current)
        _copy(current, self._weights)
        try:
            outputs = runner.run(packed, loss_function, forward_only=True)
        finally:
            _copy(current, self._scratch)
        return outputs[0]["lp"] if outputs else None


def _copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """One multi-tensor copy where both sides share a device; else one non-blocking copy per
    tensor (pinned host memory), in stream order like the kernels around it."""
    if all(t.device == s.device for t, s in zip(targets, sources, strict=True)):
        torch._foreach_copy_(targets, sources)
        return
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source, non_blocking=True)
