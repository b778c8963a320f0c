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

from typing import Any

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


class SequenceParallelRMSNorm:
    """megatron's torch RMSNorm (`WrappedTorchNorm`, which refuses sequence parallelism) for a
    sequence-parallel model: each TP rank normalizes its part of the positions with the same
    weight, so the weight is marked `sequence_parallel` and megatron adds its gradient over
    the TP group when the step's gradients are finalized."""

    # megatron builds a norm by calling its class, with these arguments positionally.
    def __new__(  # type: ignore[misc]  # noqa: PLR0917
        cls,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ) -> torch.nn.RMSNorm:
        if config.normalization != "RMSNorm":
            raise ValueError(
                f"only RMSNorm runs sequence-parallel here, not {config.normalization}"
            )
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm


def with_sequence_parallel_norms(spec: Any) -> Any:
    """`spec` (a megatron ModuleSpec tree) with every torch norm built as
    `SequenceParallelRMSNorm`; changed in place and returned."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def visit(node: Any) -> Any:
        if node is WrappedTorchNorm:
            return SequenceParallelRMSNorm
        if isinstance(node, ModuleSpec):
            if node.module is WrappedTorchNorm:
                node.module = SequenceParallelRMSNorm
            if node.submodules is not None:
                visit(node.submodules)
            return node
        if hasattr(node, "__dataclass_fields__"):
            for name in node.__dataclass_fields__:
                setattr(node, name, visit(getattr(node, name)))
        return node

    return visit(spec)
