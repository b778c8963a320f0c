"""The bucketed attention of packed rows on a GPU in bfloat16 (`--packed-attention bucketed`):
no further from the float32 per-sequence reference than the variable-length flash kernel is,
with no host round trip; then the timings of one layer's attention, forward and backward,
for the RL mix (8 and 16 sequences of 64-4,096 tokens, 16 heads of 128, 8 key/value heads):
varlen, bucketed (at a few per-call costs, with the dense kernel pinned to cuDNN or flash,
with keys and values repeated instead of grouped), the same sequences in right-padded rows,
and single calls on fresh lengths (what new shapes cost, a kernel's set-up included). Run on
a lent GPU machine: ``python -m pytest -m gpu tests/gpu/test_bucketed_attention_gpu.py -s``
(with $OUT set, the timings also go to $OUT/bucketed_attention_timings.json)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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


def _documents(lengths: list[int], *, buckets: bool):
    from trainer_svc.runtime.documents import bounds

    positions = torch.cat([torch.arange(n) for n in lengths]).cuda()
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32).cuda()
    plan = None
    if buckets:
        plan = bucketed_attention.plan(lengths, _upload)
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


def _upload(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(values).cuda()


def _layer(lengths: list[int], heads: int, groups: int, dim: int) -> dict[str, Callable[..., None]]:
    """One layer's attention forward and backward over `lengths` in bfloat16, as callables:
    varlen on the packed row, bucketed (given a plan, made once for every layer in the trainer,
    and whether to repeat keys and values instead of grouping them), and padded on the same
    sequences right-padded (made once, outside the timing, as the padded layout's rows hold
    them)."""
    total, longest = sum(lengths), max(lengths)
    leaves = [
        torch.randn(total, n, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for n in (heads, groups, groups)
    ]
    grad = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32, device="cuda")
    flash = _varlen_call(leaves[0], None, True, 0.0)
    assert flash is not None

    def varlen() -> None:
        out = flash(*leaves, cu, cu, longest, longest)
        torch.autograd.grad(out, leaves, grad)

    def bucketed(plan: bucketed_attention.BucketPlan, repeat_kv: bool = False) -> None:
        q, k, v = leaves
        if repeat_kv:
            k, v = (x.repeat_interleave(heads // groups, dim=1) for x in (k, v))
        out = bucketed_attention.attend(q, k, v, plan, scale=None, grouped=not repeat_kv)
        torch.autograd.grad(out, leaves, grad)

    rows = [
        torch.zeros(len(lengths), longest, x.shape[1], dim, device="cuda", dtype=torch.bfloat16)
        for x in leaves
    ]
    start = 0
    for row, n in enumerate(lengths):
        for pad, x in zip(rows, leaves, strict=True):
            pad[row, :n] = x.detach()[start : start + n]
        start += n
    for x in rows:
        x.requires_grad_()
    rows_grad = torch.randn(len(lengths), heads, longest, dim, device="cuda", dtype=torch.bfloat16)

    def padded() -> None:
        q, k, v = (x.transpose(1, 2) for x in rows)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.autograd.grad(out, rows, rows_grad)

    return {"varlen": varlen, "bucketed": bucketed, "padded": padded}


def _timed(run: Callable[[], None], backend: str = "default") -> float | str:
    try:
        with _backend(backend):
            return _median_ms(run)
    except RuntimeError as error:
        return f"refused: {str(error).splitlines()[0][:160]}"


def _cold_ms(run: Callable[[], None]) -> float:
    """Wall time of one call, shapes possibly never seen before (kernel set-up included)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start)


@in_child_process
def test_print_one_layers_attention_timings_for_the_rl_mix() -> None:
    """Timings only (medians of 10 after 3 warm-up calls, then single calls on fresh lengths);
    the assertions are elsewhere."""
    heads, groups, dim = 16, 8, 128
    rng = np.random.default_rng(0)
    report: dict[str, dict[str, float | str]] = {}
    default = bucketed_attention.CALL_TOKENS
    for count in (8, 16):
        lengths = rng.integers(64, 4097, size=count).tolist()
        runs = _layer(lengths, heads, groups, dim)
        timings: dict[str, float | str] = {"lengths": str(sorted(lengths))}
        timings["varlen"] = _timed(runs["varlen"])
        for backend in ("default", "cudnn", "flash"):
            timings[f"padded {backend}"] = _timed(runs["padded"], backend)
        variants: list[tuple[str, dict[str, Any], str]] = [
            (f"call_tokens={default}", {}, "default"),
            (f"call_tokens={default}", {}, "cudnn"),
            (f"call_tokens={default}", {}, "flash"),
            (f"call_tokens={default} kv repeated", {"repeat_kv": True}, "default"),
            (f"call_tokens={default} multiple=1", {"multiple": 1}, "default"),
        ]
        variants += [
            (f"call_tokens={c}", {"call_tokens": c}, "default") for c in (0, 512, 2048, 4096)
        ]
        for name, options, backend in variants:
            repeat_kv = options.pop("repeat_kv", False)
            plan = bucketed_attention.plan(lengths, _upload, **options)
            run = functools.partial(runs["bucketed"], plan, repeat_kv)
            timings[f"bucketed {name} {backend}"] = _timed(run, backend)
        for c in (0, 512, default, 2048, 4096):
            shapes = bucketed_attention.plan(lengths, call_tokens=c).shapes
            timings[f"buckets call_tokens={c}"] = str(shapes)
        real = sum(n * n for n in lengths) / (count * max(lengths) ** 2)
        print(
            f"\n{count} sequences, {sum(lengths)} tokens, one layer's attention forward and "
            f"backward in ms ({heads} heads of {dim}, {groups} KV heads; real causal work "
            f"{real:.2f} of the padded rows')"
        )
        for name, value in timings.items():
            print(f"  {name}: {value:.3f}" if isinstance(value, float) else f"  {name}: {value}")
        report[f"{count} sequences"] = timings
    # Fresh lengths each call: what a step with new rollouts pays, kernel set-up included.
    cold: dict[str, float | str] = {}
    for draw in range(3):
        lengths = rng.integers(64, 4097, size=16).tolist()
        runs = _layer(lengths, heads, groups, dim)
        plan = bucketed_attention.plan(lengths, _upload)
        torch.cuda.synchronize()
        for name in ("varlen", "bucketed", "padded"):
            run = functools.partial(runs[name], plan) if name == "bucketed" else runs[name]
            cold[f"draw {draw} {name}"] = _cold_ms(run)
    print("\n16 fresh sequences, one call each (ms, wall, set-up included):")
    for name, value in cold.items():
        print(f"  {name}: {value:.3f}")
    report["fresh lengths"] = cold
    out = os.environ.get("OUT")
    if out:
        Path(out, "bucketed_attention_timings.json").write_text(json.dumps(report, indent=2))
