"""The optimizer update's multi-tensor kernels when neither Transformer Engine nor Apex is
installed.

megatron-core then falls back to per-parameter Python loops: its gradient norm takes one norm
per parameter and builds a host tensor from the list (a device synchronization per parameter),
its scale and copy helpers launch one or two kernels per parameter, and torch's Adam(W) runs
its `foreach` implementation (about ten multi-tensor passes over the states). With
`UpdateKernels.FUSED` the same quantities come from torch's multi-tensor ops (`_foreach_*`, a
few launches for all parameters, one synchronization where megatron needs the norm on the
host) and the update from torch's single-pass `fused` Adam(W) on CUDA. The copies and scales
are bit-identical to megatron's loops, and so is the norm on the CPU (the same per-tensor
norms, then the norm of them); on CUDA the norm's reductions run in another order and the
fused Adam rounds differently from the foreach one, in the last bits, which is why
`UpdateKernels.STOCK` stays available to compare against.

megatron looks these helpers up as module globals at call time, so swapping them there is
enough; with Transformer Engine or Apex installed megatron uses their kernels and nothing is
swapped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from megatron.core import utils as megatron_utils
from megatron.core.optimizer import clip_grads as megatron_clip_grads
from megatron.core.optimizer import optimizer as megatron_optimizer

from trainer_svc.config import UpdateKernels

_STOCK_NORM = megatron_utils.local_multi_tensor_l2_norm
_STOCK_SCALE = megatron_utils.local_multi_tensor_scale


def l2_norm(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    per_tensor: bool,
    *args: Any,
) -> tuple[torch.Tensor, None]:
    """The 2-norm of all tensors of `tensor_lists[0]` as one, a 1-element float32 tensor on
    their device (apex's `multi_tensor_l2norm` signature, without the per-tensor output)."""
    tensors = list(tensor_lists[0])
    norms = torch._foreach_norm(tensors)
    total = torch.linalg.vector_norm(torch.stack(norms).float())
    return total.reshape(1), None


def scale(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    factor: float,
) -> None:
    """`tensor_lists[1][i] = tensor_lists[0][i] * factor` for every i (apex's
    `multi_tensor_scale`); in place when the two lists are one."""
    sources, targets = list(tensor_lists[0]), list(tensor_lists[1])
    if not sources:
        return
    if all(s is t for s, t in zip(sources, targets, strict=True)):
        if factor != 1.0:
            torch._foreach_mul_(targets, factor)
        return
    torch._foreach_copy_(targets, sources if factor == 1.0 else torch._foreach_mul(sources, factor))


def megatron_uses_local_kernels() -> bool:
    """True when megatron fell back to its own per-tensor loops (no TE, no Apex)."""
    return megatron_clip_grads.l2_norm_impl in (_STOCK_NORM, l2_norm)


def install(kernels: UpdateKernels) -> None:
    """Point megatron's fallback helpers at `kernels` (process-wide; a process builds one
    model). Nothing changes when megatron runs TE's or Apex's kernels."""
    if not megatron_uses_local_kernels():
        return
    fused = kernels is UpdateKernels.FUSED
    megatron_clip_grads.l2_norm_impl = l2_norm if fused else _STOCK_NORM
    megatron_clip_grads.multi_tensor_scale_impl = scale if fused else _STOCK_SCALE
    megatron_optimizer.multi_tensor_scale_impl = scale if fused else _STOCK_SCALE


def use_fused_adam(optimizer: Any, kernels: UpdateKernels) -> None:
    """Switch each torch Adam(W) inside megatron's optimizer to torch's single-pass fused
    implementation when its parameters live on CUDA. Call before the optimizer state exists:
    the fused implementation keeps the step count on the device."""
    if kernels is not UpdateKernels.FUSED:
        return
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        if not isinstance(torch_optimizer, torch.optim.Adam | torch.optim.AdamW):
            continue
        groups = torch_optimizer.param_groups
        if not all(p.is_cuda for group in groups for p in group["params"]):
            continue
        assert not torch_optimizer.state, "switch to fused Adam before its state exists"
        torch_optimizer.defaults.update(fused=True, foreach=False)
        for group in groups:
            group.update(fused=True, foreach=False)
