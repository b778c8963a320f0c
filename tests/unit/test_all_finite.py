"""`all_finite`, FinishTrainStep's check of every rank's gradient buffers before the update:
NaN and infinities anywhere are found, the largest finite values are not mistaken for an
overflow, and empty buffers are skipped; `contents` also says whether every element is zero.
Its memory on a GPU: tests/gpu/test_all_finite_gpu.py.
The refusal of a step whose gradients overflow: tests/trainer/test_failed_commands.py."""

from __future__ import annotations

import pytest
import torch

from trainer_svc.runtime.finite import all_finite, contents


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_element_anywhere_is_found(dtype: torch.dtype, bad: float) -> None:
    for at in (0, 517, 999):
        grads = [torch.zeros(7, dtype=dtype), torch.zeros(1000, dtype=dtype)]
        grads[1][at] = bad
        assert not all_finite(grads), (dtype, bad, at)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_largest_finite_values_are_finite(dtype: torch.dtype) -> None:
    # Their sum would overflow in the tensor's own dtype; a minimum and a maximum cannot.
    top = torch.finfo(dtype).max
    assert all_finite([torch.full((1000,), top, dtype=dtype), torch.full((3,), -top, dtype=dtype)])


def test_no_buffers_and_empty_buffers_are_finite() -> None:
    assert all_finite([])
    assert all_finite([torch.zeros(0), torch.ones(4)])
    assert not all_finite([torch.zeros(0), torch.tensor([1.0, float("nan")])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_contents_say_whether_every_element_is_zero(dtype: torch.dtype) -> None:
    """FinishTrainStep's no-op check: zero exactly when every element is, the smallest
    non-zero value (of either sign) included, from the same pass as the finite check."""
    tiny = torch.finfo(dtype).smallest_normal
    assert contents([torch.zeros(7, dtype=dtype), -torch.zeros(3, dtype=dtype)]) == (True, True)
    for value in (tiny, -tiny, 1.0):
        grads = [torch.zeros(7, dtype=dtype), torch.zeros(1000, dtype=dtype)]
        grads[1][517] = value
        assert contents(grads) == (True, False), value
    grads = [torch.zeros(7, dtype=dtype)]
    grads[0][3] = float("nan")
    assert not contents(grads).finite
    assert contents([]) == (True, True) and contents([torch.zeros(0)]) == (True, True)
