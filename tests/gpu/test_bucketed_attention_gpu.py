"""The bucketed attention of packed rows on a GPU in bfloat16 (`--packed-attention bucketed`):
no further from the float32 per-sequence reference than the variable-length flash kernel is,
with no host round trip; then the timings of one layer's attention, forward and backward,
for the RL mix (8 and 16 sequences of 64-4,096 tokens, 16 heads of 128, 8 key/value heads):
varlen, bucketed (at a few per-call costs, and with the dense kernel pinned to cuDNN or
flash), and the same sequences in right-padded rows. Run on a lent GPU machine:
``python -m pytest -m gpu tests/gpu/test_bucketed_attention_gpu.py -s`` (with $OUT set, the
timings also go to $OUT/bucketed_attention_timings.json)."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.support.isolation import in_child_process
from tests.support.megatron_world import attention_config, one_rank_model_parallel
from trainer_svc.runtime import bucketed_attention
from trainer_svc.runtime.sdpa_attention import SdpaAttention, _varlen_call

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _documents(lengths: list[int], *, buckets: bool, call_tokens: int | None = None):
    from trainer_svc.runtime.documents import bounds

    positions = torch.cat([torch.arange(n) for n in lengths]).cuda()
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32).cuda()
    plan = None
    if buckets:
        plan = bucketed_attention.plan(
            lengths,
            lambda a: torch.from_numpy(a).cuda(),
            call_tokens=bucketed_attention.CALL_TOKENS if call_tokens is None else call_tokens,
        )
    return bounds(lengths, positions, cu, plan)


def _packed(module, inputs, grad, dtype, documents):
    leaves = [x.to(dtype).clone().requires_grad_() for x in inputs]
    out = module(*leaves, None, packed_seq_params=documents)
    out.backward(grad.to(dtype))
    return [out.float()] + [x.grad.float() for x in leaves]


@in_child_process
def test_bucketed_is_as_close_to_float32_as_varlen_without_a_sync() -> None:
    one_rank_model_parallel(cuda=True)
    torch.manual_seed(0)
    lengths, heads, dim = [700, 33, 1024, 5, 290, 1, 2049, 640], 16, 128
    total = sum(lengths)
    varlen, bucketed = (_documents(lengths, buckets=b) for b in (False, True))
    assert bucketed.buckets is not None
    print(f"buckets (rows, longest): {bucketed.buckets.shapes}")
    for groups in (16, 8, 1):
        full, half = (
            SdpaAttention(
                attention_config(heads, groups, dim, dtype), 1, AttnMaskType.causal, "self"
            )
            for dtype in (torch.float32, torch.bfloat16)
        )
        inputs = [torch.randn(total, 1, n, dim, device="cuda") for n in (heads, groups, groups)]
        grad = torch.randn(total, 1, heads * dim, device="cuda")
        reference = _packed(full, inputs, grad, torch.float32, varlen)  # per-sequence, fp32
        flash = _packed(half, inputs, grad, torch.bfloat16, varlen)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            dense = _packed(half, inputs, grad, torch.bfloat16, bucketed)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for what, ref, got, base in zip(
            ("out", "dq", "dk", "dv"), reference, dense, flash, strict=True
        ):
            err, base_err = (got - ref).abs().max().item(), (base - ref).abs().max().item()
            print(f"groups {groups} {what}: max |err| varlen {base_err:.3g}, bucketed {err:.3g}")
            assert err <= 1.5 * base_err + 1e-3, (groups, what, base_err, err)


def _median_ms(run: Callable[[], None], warmup: int = 3, iterations: int = 10) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@contextlib.contextmanager
def _backend(name: str) -> Iterator[None]:
    if name == "default":
        yield
        return
    chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[name]
    with sdpa_kernel([chosen]):
        yield


@in_child_process
def test_print_one_layers_attention_timings_for_the_rl_mix() -> None:
    """Timings only (medians of 10 after 3 warm-up calls); the assertions are elsewhere."""
    heads, groups, dim = 16, 8, 128
    rng = np.random.default_rng(0)
    report: dict[str, dict[str, float | str]] = {}
    for count in (8, 16):
        lengths = rng.integers(64, 4097, size=count).tolist()
        total, longest = sum(lengths), max(lengths)
        leaves = [
            torch.randn(total, n, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for n in (heads, groups, groups)
        ]
        grad = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32, device="cuda")
        varlen = _varlen_call(leaves[0], None, True, 0.0)
        assert varlen is not None
        timings: dict[str, float | str] = {}

        def run_varlen(varlen=varlen, leaves=leaves, grad=grad, cu=cu, longest=longest) -> None:
            out = varlen(*leaves, cu, cu, longest, longest)
            torch.autograd.grad(out, leaves, grad)

        timings["varlen"] = _median_ms(run_varlen)
        for call_tokens in (0, 512, bucketed_attention.CALL_TOKENS, 2048, 4096):
            plan = bucketed_attention.plan(
                lengths, lambda a: torch.from_numpy(a).cuda(), call_tokens=call_tokens
            )

            def run_bucketed(plan=plan, leaves=leaves, grad=grad) -> None:
                out = bucketed_attention.attend(*leaves, plan, scale=None, grouped=True)
                torch.autograd.grad(out, leaves, grad)

            backends = ("default", "cudnn", "flash")
            for backend in (
                backends if call_tokens == bucketed_attention.CALL_TOKENS else ("default",)
            ):
                name = f"bucketed call_tokens={call_tokens} {backend}"
                try:
                    with _backend(backend):
                        timings[name] = _median_ms(run_bucketed)
                except RuntimeError as error:
                    timings[name] = f"refused: {str(error).splitlines()[0][:120]}"
            timings[f"buckets call_tokens={call_tokens}"] = str(plan.shapes)
        # The same sequences right-padded, as the padded layout's rows hold them.
        padded = [
            torch.zeros(count, longest, x.shape[1], dim, device="cuda", dtype=torch.bfloat16)
            for x in leaves
        ]
        start = 0
        for row, n in enumerate(lengths):
            for pad, x in zip(padded, leaves, strict=True):
                pad[row, :n] = x.detach()[start : start + n]
            start += n
        padded = [x.requires_grad_() for x in padded]
        padded_grad = torch.randn(count, heads, longest, dim, device="cuda", dtype=torch.bfloat16)

        def run_padded(padded=padded, padded_grad=padded_grad) -> None:
            q, k, v = (x.transpose(1, 2) for x in padded)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            torch.autograd.grad(out, padded, padded_grad)

        for backend in ("default", "cudnn", "flash"):
            try:
                with _backend(backend):
                    timings[f"padded {backend}"] = _median_ms(run_padded)
            except RuntimeError as error:
                timings[f"padded {backend}"] = f"refused: {str(error).splitlines()[0][:120]}"
        work = sum(n * n for n in lengths) / (count * longest * longest)
        print(
            f"\n{count} sequences, {total} tokens (lengths {sorted(lengths)}), one layer's "
            f"attention forward+backward, {heads} heads of {dim}, {groups} KV heads; real "
            f"causal work {work:.2f} of the padded rows'"
        )
        for name, value in timings.items():
            print(f"  {name}: {value:.3f} ms" if isinstance(value, float) else f"  {name}: {value}")
        report[f"{count} sequences"] = dict(timings, lengths=str(lengths))
    out = os.environ.get("OUT")
    if out:
        Path(out, "bucketed_attention_timings.json").write_text(json.dumps(report, indent=2))
