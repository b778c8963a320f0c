"""The fused attention (`SdpaAttention`) against megatron's local DotProductAttention it replaces
when Transformer Engine is absent: the same outputs and input gradients for multi-head,
grouped-query and multi-query attention, causal, in float32 on the CPU (a GPU's bf16 kernels are
held to the same reference by tests/gpu); and which spec each `--attention` choice builds. The
whole-model checks (split-step equivalence, TP/PP layouts, HF parity, refit fidelity) run with
SDPA, the CPU default."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_hf.spec import ModelSpec
from tests.support.isolation import in_child_process
from tests.support.megatron_world import attention_config, one_rank_model_parallel
from trainer_svc.builtin_model import write_builtin_model
from trainer_svc.config import Attention
from trainer_svc.runtime.model_factory import layer_spec_for
from trainer_svc.runtime.sdpa_attention import SdpaAttention


@in_child_process
def test_sdpa_equals_the_local_attention_with_its_gradients() -> None:
    from trainer_svc.runtime import cpu_compat

    one_rank_model_parallel(cuda=False)
    torch.manual_seed(0)
    seq, batch, heads, dim = 37, 3, 8, 16
    for groups in (8, 2, 1):  # MHA, GQA, MQA
        config = attention_config(heads, groups, dim, torch.float32)
        local = DotProductAttention(config, 1, AttnMaskType.causal, "self")
        fused = SdpaAttention(config, 1, AttnMaskType.causal, "self")
        inputs = [
            torch.randn(seq, batch, n, dim, dtype=torch.float32) for n in (heads, groups, groups)
        ]
        grad = torch.randn(seq, batch, heads * dim)
        results = []
        for module in (local, fused):
            leaves = [x.clone().requires_grad_() for x in inputs]
            with cpu_compat.active():  # megatron's scratch buffer lives on "cuda"
                out = module(*leaves, None)
            out.backward(grad)
            results.append((out.detach(), [x.grad for x in leaves]))
        (want, want_grads), (got, got_grads) = results
        assert got.shape == want.shape == (seq, batch, heads * dim)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for g, w in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        # The first position attends to itself only: causal, not bidirectional.
        torch.testing.assert_close(
            got[0].view(batch, heads, dim),
            inputs[2][0].repeat_interleave(heads // groups, dim=1),
        )


@pytest.mark.parametrize(
    ("attention", "on_gpu", "expected"),
    [
        (Attention.AUTO, False, SdpaAttention),
        (Attention.SDPA, False, SdpaAttention),
        (Attention.LOCAL, False, DotProductAttention),
        (Attention.SDPA, True, SdpaAttention),
    ],
)
def test_each_attention_choice_builds_its_core_attention(tmp_path, attention, on_gpu, expected):
    spec = ModelSpec.from_pretrained_dir(write_builtin_model(tmp_path / "model", seed=1))
    layer = layer_spec_for(spec, attention, on_gpu=on_gpu)
    assert layer.submodules.self_attention.submodules.core_attention is expected
