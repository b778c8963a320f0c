"""The fused attention on a GPU, in bfloat16 (its flash or memory-efficient kernel): output and
input gradients against megatron's local attention run in float32 on the same inputs; the
fused path must be no further from that reference than the local path in bfloat16 is. Run on a
lent GPU machine: ``python -m pytest -m gpu tests/gpu -s``."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from tests.support.isolation import in_child_process
from tests.support.megatron_world import attention_config, one_rank_model_parallel
from trainer_svc.config import PackedAttention
from trainer_svc.runtime.sdpa_attention import SdpaAttention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _assert_as_close(case, reference, candidate, baseline):
    """Each of out, dq, dk, dv of `candidate` (name, values) is no further from `reference`
    than `baseline`'s is, with some slack; prints both distances."""
    (name, got), (base_name, base) = candidate, baseline
    for what, ref, g, b in zip(("out", "dq", "dk", "dv"), reference, got, base, strict=True):
        err, base_err = (g - ref).abs().max().item(), (b - ref).abs().max().item()
        print(f"{case} {what}: max |err| {base_name} {base_err:.3g}, {name} {err:.3g}")
        assert err <= 1.5 * base_err + 1e-3, (case, what, base_err, err)


def _run(module, inputs, grad, dtype):
    leaves = [x.to(dtype).clone().requires_grad_() for x in inputs]
    out = module(*leaves, None)
    out.backward(grad.to(dtype))
    return [out.float()] + [x.grad.float() for x in leaves]


@in_child_process
def test_sdpa_in_bf16_is_as_close_to_fp32_as_the_local_attention() -> None:
    one_rank_model_parallel(cuda=True)
    torch.manual_seed(0)
    seq, batch, heads, dim = 1024, 2, 16, 128
    for groups in (16, 8, 1):

        def make(dtype, cls, groups=groups):
            return cls(attention_config(heads, groups, dim, dtype), 1, AttnMaskType.causal, "self")

        inputs = [torch.randn(seq, batch, n, dim, device="cuda") for n in (heads, groups, groups)]
        grad = torch.randn(seq, batch, heads * dim, device="cuda")
        reference = _run(make(torch.float32, DotProductAttention), inputs, grad, torch.float32)
        local = _run(make(torch.bfloat16, DotProductAttention), inputs, grad, torch.bfloat16)
        fused = _run(make(torch.bfloat16, SdpaAttention), inputs, grad, torch.bfloat16)
        _assert_as_close(f"groups {groups}", reference, ("sdpa", fused), ("local", local))


def _packed(module, inputs, grad, dtype, documents):
    leaves = [x.to(dtype).clone().requires_grad_() for x in inputs]
    out = module(*leaves, None, packed_seq_params=documents)
    out.backward(grad.to(dtype))
    return [out.float()] + [x.grad.float() for x in leaves]


def _rows(module, inputs, grad, dtype, lengths):
    """Each sequence run as its own row: [out, dq, dk, dv], concatenated back."""
    outs: list[list[torch.Tensor]] = [[], [], [], []]
    start = 0
    for n in lengths:
        got = _run(module, [x[start : start + n] for x in inputs], grad[start : start + n], dtype)
        for keep, value in zip(outs, got, strict=True):
            keep.append(value)
        start += n
    return [torch.cat(values) for values in outs]


@in_child_process
def test_packed_rows_through_varlen_flash_are_as_close_as_padded_rows_without_a_sync() -> None:
    """A packed row of uneven sequences in bfloat16 goes through PyTorch's variable-length
    flash kernel (one launch, no host round trip), and is no further from the float32
    per-sequence reference than the same sequences run as their own rows in bfloat16."""
    from trainer_svc.runtime.documents import bounds
    from trainer_svc.runtime.sdpa_attention import _varlen_call

    one_rank_model_parallel(cuda=True)
    torch.manual_seed(0)
    lengths, heads, dim = [700, 33, 1024, 5, 290], 16, 128
    total = sum(lengths)
    positions = torch.cat([torch.arange(n) for n in lengths]).cuda()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).cuda()
    documents = bounds(lengths, positions, cu)
    for groups in (16, 4, 1):
        configs = {
            dtype: attention_config(heads, groups, dim, dtype)
            for dtype in (torch.float32, torch.bfloat16)
        }
        full, half = (
            SdpaAttention(configs[dtype], 1, AttnMaskType.causal, "self")
            for dtype in (torch.float32, torch.bfloat16)
        )
        half.packed_attention = PackedAttention.FLASH  # cuDNN's: test_ragged_attention_gpu.py
        inputs = [torch.randn(total, 1, n, dim, device="cuda") for n in (heads, groups, groups)]
        grad = torch.randn(total, 1, heads * dim, device="cuda")
        assert _varlen_call(inputs[0][:, 0].bfloat16(), None, groups != heads, 0.0) is not None
        reference = _packed(full, inputs, grad, torch.float32, documents)  # per-sequence loop
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fused = _packed(half, inputs, grad, torch.bfloat16, documents)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        separate = _rows(half, inputs, grad, torch.bfloat16, lengths)
        _assert_as_close(f"groups {groups}", reference, ("varlen", fused), ("rows", separate))
