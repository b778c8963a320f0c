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
from trainer_svc.runtime.sdpa_attention import SdpaAttention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


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
        names = ("out", "dq", "dk", "dv")
        for name, ref, lo, fu in zip(names, reference, local, fused, strict=True):
            local_err = (lo - ref).abs().max().item()
            fused_err = (fu - ref).abs().max().item()
            print(f"groups {groups} {name}: max |err| local {local_err:.3g}, sdpa {fused_err:.3g}")
            assert fused_err <= 1.5 * local_err + 1e-3, (groups, name, local_err, fused_err)
