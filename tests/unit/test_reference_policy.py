"""The reference policy's swap (`runtime/reference_policy.py`): a pass scored with it sees the
captured weights, the trained weights come back bit for bit, and the copy lives where its
placement says (on a GPU with HOST: pinned host memory, no device memory). The whole step with
the reference is checked against the formula in tests/trainer/test_rl_losses_hf.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trainer_svc.config import ReferencePlacement
from trainer_svc.runtime.reference_policy import ReferencePolicy

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


class _Pass:
    """What `ModelRunner.run` does for a forward-only pass, on a plain module and one input:
    the scoring function applied to its logits (and the weights the pass computed with)."""

    def __init__(self, model: torch.nn.Module, inputs: torch.Tensor) -> None:
        self.model, self.inputs = model, inputs
        self.weights: list[torch.Tensor] = []

    def run(self, packed: Any, loss_function: Any, *, forward_only: bool) -> list[dict]:
        assert forward_only
        self.weights = [p.detach().clone() for p in self.model.parameters()]
        return [loss_function(packed, self.model(self.inputs))[2]]


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _score(batch: Any, logits: torch.Tensor) -> torch.Tensor:
    return logits.log_softmax(-1)


@pytest.mark.parametrize("placement", list(ReferencePlacement))
@pytest.mark.parametrize("device", DEVICES)
def test_a_pass_scores_with_the_reference_and_the_trained_weights_come_back(
    device: str, placement: ReferencePlacement
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).to(device)
    inputs = torch.randn(4, 16, device=device)
    initial = _weights(model)
    allocated = torch.cuda.memory_allocated() if device == "cuda" else 0
    policy = ReferencePolicy(model, placement)
    on_host = device == "cuda" and placement is ReferencePlacement.HOST
    if device == "cuda":
        grown = torch.cuda.memory_allocated() - allocated
        # The caching allocator rounds every block up to 512 bytes.
        assert grown == 0 if on_host else policy.nbytes <= grown <= policy.nbytes + 4 * 512, grown
    if on_host:
        assert all(w.device.type == "cpu" and w.is_pinned() for w in policy._weights)
    with torch.no_grad():  # a training step moves the weights
        for parameter in model.parameters():
            parameter.mul_(1.5).add_(0.25)
    trained = _weights(model)
    with torch.no_grad():
        expected = _score(None, torch.nn.functional.linear(inputs, *initial))

    scored = _Pass(model, inputs)
    logprobs = policy.logprobs(scored, None, _score)  # type: ignore[arg-type]
    assert logprobs is not None and torch.equal(logprobs, expected)
    assert all(torch.equal(a, b) for a, b in zip(scored.weights, initial, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(_weights(model), trained, strict=True))

    policy.capture()  # SetReference: the trained weights become the reference
    logprobs = policy.logprobs(scored, None, _score)  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(scored.weights, trained, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(_weights(model), trained, strict=True))
