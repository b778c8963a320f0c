"""RMSNorm in one fused kernel under low-precision parameters.

Without Transformer Engine or Apex, megatron builds its norms as `torch.nn.RMSNorm` without a
dtype (`WrappedTorchNorm`), so their weights are float32 while a bf16 model's activations are
bf16. PyTorch fuses `rms_norm` only when input and weight share a dtype; otherwise it runs the
composite, many kernels forward and backward, each a host launch that a small step
waits on. `ActivationDtypeRMSNorm` keeps the weight a float32 parameter (the optimizer,
checkpoints and publication see nothing new) and hands the kernel the weight cast to the
activations' dtype: one cast of `hidden` elements, then the fused kernel (the counts:
`tests/gpu/test_norms_gpu.py`). That is also how the
inference side applies the norm of a bf16 model (vLLM and transformers hold the weight in bf16),
so the trainer's forward after a step uses exactly the norm weight a refit installs. In float32
nothing changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ActivationDtypeRMSNorm(torch.nn.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight: torch.Tensor | None = self.weight
        if weight is not None and weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


def install(model: torch.nn.Module) -> int:
    """Turns every plain `torch.nn.RMSNorm` of `model` into `ActivationDtypeRMSNorm` in place
    (same parameters, same state dict); returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.RMSNorm:
            module.__class__ = ActivationDtypeRMSNorm
            count += 1
    return count
