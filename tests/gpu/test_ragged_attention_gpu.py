"""cuDNN's ragged-layout attention for packed rows (`runtime/ragged_attention.py`) on a GPU in
bfloat16: no further from the float32 per-sequence reference than PyTorch's variable-length
flash kernel, with no host round trip, for grouped and ungrouped heads and a strided value
(megatron's value is a view into the fused QKV projection), seven sequences run as eight with
an empty one; new lengths and counts within a graph's buckets build no graph; the backward is
bit-identical under deterministic algorithms. Then one layer's attention timings, forward and
backward: the RL mix (8 and 16 sequences of 64-4,096 tokens, 16 heads of 128, 8 key/value
heads) through ragged cuDNN, varlen flash, and right-padded rows through cuDNN's dense kernel;
rows of equal lengths, ragged against dense. Run on a lent GPU machine:
``python -m pytest -m gpu tests/gpu/test_ragged_attention_gpu.py -s`` (with $OUT set, the
timings also go to $OUT/ragged_attention_timings.json)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.support.cuda_timing import median_ms
from tests.support.isolation import in_child_process
from trainer_svc.runtime import determinism, ragged_attention
from trainer_svc.runtime.sdpa_attention import _varlen_call

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _attend(*args: torch.Tensor, **kwargs: object) -> torch.Tensor:
    out = ragged_attention.attention(*args, **kwargs)  # type: ignore[arg-type]
    assert out is not None, "cuDNN built no graph for this row"
    return out


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32, device="cuda")


def _reference(q, k, v, lengths, scale):
    """Float32, one fused causal call per sequence."""
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start : start + n].float().transpose(0, 1)[None] for x in (q, k, v))
        out = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        outs.append(out[0].transpose(0, 1))
        start += n
    return torch.cat(outs)


def _grads(run, inputs, grad):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = run(*leaves)
    out.backward(grad.to(out.dtype))
    return [out.float()] + [x.grad.float() for x in leaves]


def _strided_value(value: torch.Tensor) -> torch.Tensor:
    """`value` as a view with a token stride wider than its heads, as megatron's is."""
    tokens, groups, dim = value.shape
    wide = torch.zeros(tokens, groups, 3 * dim, dtype=value.dtype, device=value.device)
    wide[:, :, dim : 2 * dim] = value
    return wide[:, :, dim : 2 * dim]


@in_child_process
def test_ragged_is_as_close_to_float32_as_varlen_without_a_sync() -> None:
    assert ragged_attention.applies(torch.empty(1, 1, 128, device="cuda").bfloat16(), 0.0)
    torch.manual_seed(0)
    lengths, heads, dim = [700, 33, 1024, 5, 290, 1, 2049], 16, 128
    total, scale = sum(lengths), dim**-0.5
    cu, longest = _cu(lengths), max(lengths)
    for groups in (16, 8, 1):
        q, k, v = (torch.randn(total, n, dim, device="cuda") for n in (heads, groups, groups))
        grad = torch.randn(total, heads, dim, device="cuda")
        reference = _grads(lambda *x: _reference(*x, lengths, scale), [q, k, v], grad)
        half = [x.bfloat16() for x in (q, k, v)]
        varlen = _varlen_call(half[0], scale, groups != heads, 0.0)
        assert varlen is not None
        flash = _grads(lambda *x, f=varlen: f(*x, cu, cu, longest, longest), half, grad)
        for strided in (False, True):

            def ragged(q, k, v, strided=strided):
                v = _strided_value(v) if strided else v
                return _attend(q, k, v, cu_seqlens=cu, longest=longest, scale=scale)

            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = _grads(ragged, half, grad)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            for what, ref, g, b in zip(
                ("out", "dq", "dk", "dv"), reference, got, flash, strict=True
            ):
                err, base = (g - ref).abs().max().item(), (b - ref).abs().max().item()
                print(
                    f"groups {groups} strided {strided} {what}: varlen {base:.3g}, ragged {err:.3g}"
                )
                assert err <= 1.5 * base + 1e-3, (groups, strided, what, base, err)


@in_child_process
def test_new_lengths_and_counts_in_the_same_buckets_build_no_graph() -> None:
    heads, groups, dim = 16, 8, 128

    def once(lengths: list[int]) -> float:
        total = sum(lengths)
        q = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(total, groups, dim, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        leaves = [x.requires_grad_() for x in (q, k, v)]
        torch.cuda.synchronize()
        started = time.perf_counter()
        out = _attend(*leaves, cu_seqlens=_cu(lengths), longest=max(lengths), scale=dim**-0.5)
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        return time.perf_counter() - started

    first = once([1000, 2000, 3000, 500])
    built = ragged_attention.graphs_built()
    # Fewer sequences (the table padded with an empty one), another longest in the same
    # power of two, as many tokens within a quarter of theirs: the same graphs.
    again = once([1001, 1990, 3500])
    assert ragged_attention.graphs_built() == built
    print(
        f"a new key (forward and backward graphs): {first:.3f} s; "
        f"new lengths, same key: {again * 1e3:.1f} ms"
    )
    assert again < first


def _backward_twice(lengths: list[int]) -> list[bool]:
    """Whether two identical forward and backward passes give bit-identical dq, dk, dv."""
    heads, groups, dim = 16, 8, 128
    torch.manual_seed(1)
    total = sum(lengths)
    q = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total, groups, dim, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    grad = torch.randn_like(q)
    runs = []
    for _ in range(2):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = _attend(*leaves, cu_seqlens=_cu(lengths), longest=max(lengths), scale=dim**-0.5)
        out.backward(grad)
        runs.append([x.grad for x in leaves])
    return [torch.equal(a, b) for a, b in zip(*runs, strict=True)]


@in_child_process
def test_the_backward_is_bit_identical_under_deterministic_algorithms() -> None:
    """`--deterministic` (torch's deterministic algorithms) asks cuDNN for its deterministic
    backward: two runs give the same gradients bit for bit."""
    determinism.apply(True)
    lengths = [3000, 17, 4096, 900, 2048, 64, 1500, 3333]
    assert _backward_twice(lengths) == [True, True, True]


def _layer_timings(sequences: int) -> dict[str, object]:
    """One layer's attention for `sequences` lengths drawn from 64-4,096: forward and
    backward (and forward alone) through each kernel, median milliseconds."""
    heads, groups, dim = 16, 8, 128
    scale = dim**-0.5
    lengths = np.random.default_rng(sequences).integers(64, 4097, sequences).tolist()
    total, longest, cu = sum(lengths), max(lengths), _cu(lengths)
    q = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total, groups, dim, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    leaves = [x.requires_grad_() for x in (q, k, v)]
    grad = torch.randn_like(q)
    varlen = _varlen_call(q, scale, True, 0.0)
    assert varlen is not None
    rows = [
        torch.randn(sequences, n, longest, dim, device="cuda", dtype=torch.bfloat16)
        for n in (heads, groups, groups)
    ]
    rows = [x.requires_grad_() for x in rows]
    row_grad = torch.randn_like(rows[0])

    def ragged() -> torch.Tensor:
        return _attend(*leaves, cu_seqlens=cu, longest=longest, scale=scale)

    def flash() -> torch.Tensor:
        return varlen(*leaves, cu, cu, longest, longest)

    def padded() -> None:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(*rows, is_causal=True, enable_gqa=True)
        out.backward(row_grad)

    with torch.no_grad():
        forward = {"ragged": median_ms(ragged), "varlen": median_ms(flash)}
    timings = {
        "ragged": median_ms(lambda: ragged().backward(grad)),
        "varlen": median_ms(lambda: flash().backward(grad)),
        "padded": median_ms(padded),
    }
    print(
        f"{sequences} sequences ({total} tokens): forward+backward ragged "
        f"{timings['ragged']:.2f} ms, varlen {timings['varlen']:.2f} ms, padded rows "
        f"{timings['padded']:.2f} ms; forward ragged {forward['ragged']:.2f} ms, varlen "
        f"{forward['varlen']:.2f} ms"
    )
    return {"lengths": lengths, "forward_and_backward_ms": timings, "forward_ms": forward}


def _equal_lengths_ms(sequences: int, length: int) -> dict[str, float]:
    """Rows with no padding at all: the ragged graph against cuDNN's dense kernel on the same
    rows (what `documents.PADDING_WORTH_PACKING` weighs), forward and backward."""
    heads, groups, dim = 16, 8, 128
    total, cu = sequences * length, _cu([length] * sequences)
    q = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(total, groups, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in "kv"
    )
    grad = torch.randn_like(q)
    rows = [
        x.detach().view(sequences, length, -1, dim).transpose(1, 2).requires_grad_()
        for x in (q, k, v)
    ]
    row_grad = grad.view(sequences, length, heads, dim).transpose(1, 2)

    def ragged() -> None:
        _attend(q, k, v, cu_seqlens=cu, longest=length, scale=dim**-0.5).backward(grad)

    def dense() -> None:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(*rows, is_causal=True, enable_gqa=True)
        out.backward(row_grad)

    found = {"ragged": median_ms(ragged), "dense": median_ms(dense)}
    print(
        f"{sequences} x {length} tokens, no padding: ragged {found['ragged']:.2f} ms, "
        f"dense rows {found['dense']:.2f} ms"
    )
    return found


@in_child_process
def test_one_layer_timings_for_the_rl_mix() -> None:
    results: dict[str, object] = {
        str(sequences): _layer_timings(sequences) for sequences in (8, 16)
    }
    results["equal_lengths"] = {
        f"{n}x{length}": _equal_lengths_ms(n, length)
        for n, length in ((16, 1024), (8, 2048), (4, 4096), (64, 256))
    }
    same = _backward_twice([3000, 17, 4096, 900])
    results["backward_bit_identical_without_deterministic"] = same
    print(f"backward twice with the default algorithms, bit-identical (dq, dk, dv): {same}")
    out = os.environ.get("OUT")
    if out:
        Path(out, "ragged_attention_timings.json").write_text(json.dumps(results, indent=1))
