"""Whether tensors hold only finite values, cheaply: FinishTrainStep's check of the gradient
buffers and a checkpoint load's check of what it read. FinishTrainStep learns from the same
pass whether the gradient is exactly zero."""

from __future__ import annotations

from typing import NamedTuple

import torch


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of `tensors` is finite: each tensor's minimum and maximum are
    finite exactly when all its elements are (NaN propagates through both, and nothing can
    overflow), with no tensor-sized temporary and one host sync in all. A float64 sum, used
    before, cast the whole tensor to float64 first on CUDA, which took a large model's
    FinishTrainStep out of device memory."""
    ends = _ends(tensors)
    return ends is None or bool(torch.isfinite(ends).all())


class Contents(NamedTuple):
    finite: bool
    """Every element is finite."""
    zero: bool
    """Every element is zero (a gradient that cannot move the weights)."""


def contents(tensors: list[torch.Tensor]) -> Contents:
    """`all_finite`, and whether every element is zero, from the same minima and maxima (all
    are zero exactly when every minimum and maximum is): one pass, one host sync."""
    ends = _ends(tensors)
    if ends is None:
        return Contents(finite=True, zero=True)
    finite, zero = torch.stack([torch.isfinite(ends).all(), (ends == 0).all()]).tolist()
    return Contents(finite=bool(finite), zero=bool(zero))


def _ends(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """Each tensor's minimum and maximum; None when every tensor is empty."""
    present = [t for t in tensors if t.numel()]  # aminmax refuses an empty tensor
    if not present:
        return None
    return torch.stack([end for t in present for end in torch.aminmax(t)])
