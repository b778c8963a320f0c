"""The trainer's RMSNorm under bf16 activations with its float32 weight (`runtime/norms.py`):
fewer kernels forward and backward than torch's RMSNorm, which falls back to its composite for
mixed dtypes, and the fused kernel's result with the weight cast to bf16. Prints both kernel
counts. Run on a lent GPU machine: ``python -m pytest -m gpu tests/gpu -s``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from trainer_svc.runtime import norms

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _kernels(module: torch.nn.Module, x: torch.Tensor) -> int:
    """CUDA kernels one forward and backward of `module` launches."""
    module(x).float().sum().backward()  # warm: allocations, lazy initialisation
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        module(x).float().sum().backward()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_time_total > 0)


def test_the_bf16_norm_runs_fused_with_the_cast_weight() -> None:
    torch.manual_seed(0)
    plain = torch.nn.RMSNorm(2048, eps=1e-5).cuda()
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
    swapped = torch.nn.RMSNorm(2048, eps=1e-5).cuda()
    swapped.load_state_dict(plain.state_dict())
    norms.install(swapped)
    x = torch.randn(512, 1, 2048, device="cuda").bfloat16().requires_grad_()
    expected = F.rms_norm(x.detach(), (2048,), plain.weight.detach().bfloat16(), 1e-5)
    assert torch.equal(swapped(x).detach(), expected)
    composite, fused = _kernels(plain, x), _kernels(swapped, x)
    print(f"RMSNorm bf16 forward and backward: {composite} kernels composite, {fused} fused")
    assert fused < composite
