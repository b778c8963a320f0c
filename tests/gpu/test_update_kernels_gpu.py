"""On CUDA the update's kernels match megatron-core's fallback loops within rounding, and a
torch Adam(W) inside megatron's optimizer becomes the fused one. Run on a lent GPU machine:

    python -m pytest -m gpu tests/gpu -s
"""

from __future__ import annotations

import pytest
import torch

from trainer_svc.config import UpdateKernels
from trainer_svc.runtime import update_kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _tensors() -> list[torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(5)
    return [torch.randn(n, device="cuda", generator=generator) for n in (1 << 20, 4097, 3, 65536)]


def test_norm_and_copy_on_cuda() -> None:
    tensors = _tensors()
    expected = torch.norm(torch.tensor([torch.norm(t).item() for t in tensors]))
    norm, _ = update_kernels.l2_norm(0, torch.zeros(1), [tensors], False)
    assert norm.device.type == "cuda"
    torch.testing.assert_close(norm.cpu()[0], expected, rtol=1e-6, atol=0)
    model = [torch.empty_like(t, dtype=torch.bfloat16) for t in tensors]
    update_kernels.scale(0, torch.zeros(1), [tensors, model], 1.0)
    assert all(torch.equal(m, t.bfloat16()) for m, t in zip(model, tensors, strict=True))


class _Wrapper:
    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.optimizer = inner


def test_a_cuda_adamw_becomes_the_fused_one_and_steps_as_it() -> None:
    params = [torch.nn.Parameter(t.clone()) for t in _tensors()]
    reference = [torch.nn.Parameter(t.clone()) for t in _tensors()]
    wrapper = _Wrapper(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1))
    update_kernels.use_fused_adam(wrapper, UpdateKernels.FUSED)
    assert wrapper.optimizer.param_groups[0]["fused"]
    fused = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(3):
        for p, r in zip(params, reference, strict=True):
            p.grad = torch.full_like(p, 0.1 * (step + 1))
            r.grad = p.grad.clone()
        wrapper.optimizer.step()
        fused.step()
    assert all(torch.equal(p, r) for p, r in zip(params, reference, strict=True))
    state = wrapper.optimizer.state[params[0]]
    assert state["step"].device.type == "cuda"
