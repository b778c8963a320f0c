"""The update's multi-tensor kernels compute what megatron-core's per-tensor fallback loops
compute, bit for bit on the CPU, and are swapped into megatron only as configured."""

from __future__ import annotations

import pytest
import torch
from megatron.core import utils as megatron_utils
from megatron.core.optimizer import clip_grads, optimizer

from trainer_svc.cli import parse_config
from trainer_svc.config import UpdateKernels
from trainer_svc.runtime import update_kernels


def _tensors(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    shapes = [(7, 5), (64,), (3, 3, 3), (1,), (129, 17)]
    return [torch.randn(s, generator=generator).to(dtype) for s in shapes]


def test_the_norm_is_megatrons_norm_of_per_tensor_norms() -> None:
    tensors = _tensors()
    expected = torch.norm(torch.tensor([torch.norm(t) for t in tensors]))  # megatron's loop
    norm, per_tensor = update_kernels.l2_norm(0, torch.zeros(1), [tensors], False)
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    assert torch.equal(norm[0], expected)


def test_scale_in_place_and_into_another_dtype_equals_the_loop() -> None:
    grads, expected = _tensors(), [t * 0.37 for t in _tensors()]
    update_kernels.scale(0, torch.zeros(1), [grads, grads], 0.37)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))

    main, model = _tensors(), [torch.zeros_like(t, dtype=torch.bfloat16) for t in _tensors()]
    update_kernels.scale(0, torch.zeros(1), [main, model], 1.0)
    assert all(torch.equal(m, s.to(torch.bfloat16)) for m, s in zip(model, main, strict=True))
    scaled = [torch.zeros_like(t) for t in main]
    update_kernels.scale(0, torch.zeros(1), [main, scaled], 2.5)
    assert all(torch.equal(d, s * 2.5) for d, s in zip(scaled, main, strict=True))
    update_kernels.scale(0, torch.zeros(1), [[], []], 2.0)  # nothing to do


def test_install_swaps_megatrons_fallbacks_and_stock_restores_them() -> None:
    assert update_kernels.megatron_uses_local_kernels()  # no TE or Apex here
    found = (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl)
    found_copy = optimizer.multi_tensor_scale_impl
    try:
        update_kernels.install(UpdateKernels.FUSED)
        assert clip_grads.l2_norm_impl is update_kernels.l2_norm
        assert clip_grads.multi_tensor_scale_impl is update_kernels.scale
        assert optimizer.multi_tensor_scale_impl is update_kernels.scale
        update_kernels.install(UpdateKernels.STOCK)
        assert clip_grads.l2_norm_impl is megatron_utils.local_multi_tensor_l2_norm
        assert clip_grads.multi_tensor_scale_impl is megatron_utils.local_multi_tensor_scale
        assert optimizer.multi_tensor_scale_impl is megatron_utils.local_multi_tensor_scale
    finally:  # this process's other tests see megatron as they found it
        clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl = found
        optimizer.multi_tensor_scale_impl = found_copy


class _Wrapper:
    """megatron's optimizer classes keep torch's optimizer as `.optimizer`."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.optimizer = inner


def test_fused_adam_is_chosen_for_cuda_parameters_only() -> None:
    params = [torch.nn.Parameter(t) for t in _tensors()]
    wrapper = _Wrapper(torch.optim.AdamW(params, lr=0.1))
    update_kernels.use_fused_adam(wrapper, UpdateKernels.FUSED)
    assert not wrapper.optimizer.param_groups[0]["fused"]  # CPU parameters: left as built


@pytest.mark.parametrize("flag", ["fused", "stock"])
def test_the_flag_selects_the_kernels(flag: str) -> None:
    config, _ = parse_config(["--insecure", "--update-kernels", flag])
    assert config.optimizer.kernels is UpdateKernels(flag)
    default, _ = parse_config(["--insecure"])
    assert default.optimizer.kernels is UpdateKernels.FUSED


def test_the_benchmarks_update_floor_counts_each_byte_adam_must_move() -> None:
    from benchmarks.trainer_step import adam_update_bytes

    # fp32 main weight, two moments (each read and written), the fp32 gradient read ...
    assert adam_update_bytes(1000, "float32") == 1000 * 28
    # ... and the bf16 model weight written from the main weight.
    assert adam_update_bytes(1000, "bfloat16") == 1000 * 30
