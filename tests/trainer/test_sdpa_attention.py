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


@in_child_process
def test_a_packed_row_in_buckets_equals_it_sequence_by_sequence() -> None:
    """`SdpaAttention` on a packed row whose bounds carry a bucket plan (`--packed-attention
    bucketed`) against the same row without one (one fused call per sequence on the CPU):
    outputs and input gradients within 1e-6 in float32 (of the largest value, where that is
    above 1), for MHA, GQA and MQA."""
    from trainer_svc.runtime import cpu_compat
    from trainer_svc.runtime.bucketed_attention import plan
    from trainer_svc.runtime.documents import bounds

    one_rank_model_parallel(cuda=False)
    torch.manual_seed(0)
    lengths, heads, dim = [7, 1, 30, 12, 29, 2], 8, 16
    total = sum(lengths)
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    alone = bounds(lengths, positions, cu)
    bucketed = bounds(lengths, positions, cu, plan(lengths, call_tokens=10, multiple=4))
    assert bucketed.buckets is not None and 1 < len(bucketed.buckets.shapes) < len(lengths)
    for groups in (8, 2, 1):
        module = SdpaAttention(
            attention_config(heads, groups, dim, torch.float32), 1, AttnMaskType.causal, "self"
        )
        inputs = [torch.randn(total, 1, n, dim) for n in (heads, groups, groups)]
        grad = torch.randn(total, 1, heads * dim)
        results = []
        for documents in (alone, bucketed):
            leaves = [x.clone().requires_grad_() for x in inputs]
            with cpu_compat.active():
                out = module(*leaves, None, packed_seq_params=documents)
            out.backward(grad)
            results.append([out.detach(), *(x.grad for x in leaves)])
        for want, got in zip(*results, strict=True):
            assert got.shape == want.shape
            size = max(1.0, want.abs().max().item())
            assert (got - want).abs().max().item() <= 1e-6 * size, groups


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
