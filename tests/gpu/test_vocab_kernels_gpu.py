"""The Triton vocab-parallel kernels on a GPU against the torch chunked path and the unfused
implementation: log-probabilities, entropy, and the gradient of a loss using both, in bf16 and
float32, with padded vocab columns; top-k (selected on the logits in their own dtype) against the
unfused top-k; one TP rank (the TP merge is the CPU tests' and the layout tests'). Run on a lent
GPU machine: ``python -m pytest -m gpu tests/gpu -s``."""

from __future__ import annotations

import time

import pytest
import torch

from tests.support.megatron_world import one_rank_group
from trainer_svc.runtime import vocab_kernels
from trainer_svc.runtime.vocab_parallel import (
    VocabShard,
    target_logprobs,
    target_logprobs_unfused,
    top_k,
    top_k_unfused,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory):
    with one_rank_group(tmp_path_factory.mktemp("gloo") / "rendezvous") as world:
        yield world


def _run(path, logits, targets, shard, *weights):
    w_lp, w_h = weights
    leaf = logits.clone().requires_grad_()
    logprobs, entropy = path(leaf, targets, shard, with_entropy=True)
    ((logprobs * w_lp).sum() + (entropy * w_h).sum()).backward()
    return logprobs, entropy, leaf.grad


_ROWS, _VOCAB = 1000, 32_000


def _padded_logits(group, dtype) -> tuple[VocabShard, torch.Tensor]:
    """Seeded logits of a 32,000-token vocabulary padded to 32,768 columns, the padding loud
    (unmasked, it would dominate), and the one-rank shard of them."""
    assert vocab_kernels.kernels() is not None, "Triton must run here"
    torch.manual_seed(0)
    shard = VocabShard(start=0, end=32_768, vocab_size=_VOCAB, tp_group=group, tp_size=1)
    logits = (torch.randn(_ROWS, 32_768, device="cuda") * 4).to(dtype)
    logits[:, _VOCAB:] = 60.0
    return shard, logits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernels_equal_the_torch_paths(group, dtype) -> None:
    shard, logits = _padded_logits(group, dtype)
    rows, vocab = _ROWS, _VOCAB
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    w_lp, w_h = torch.rand(rows, device="cuda"), torch.rand(rows, device="cuda")
    kernel = _run(target_logprobs, logits, targets, shard, w_lp, w_h)
    unfused = _run(target_logprobs_unfused, logits, targets, shard, w_lp, w_h)
    for got, want, name in zip(kernel, unfused, ("logprobs", "entropy", "grad"), strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3, msg=name)
    assert not kernel[2][:, vocab:].any(), "padded columns get no gradient"
    # The torch chunked path (what the CPU runs) on the same inputs, forced off the kernels.
    chunked = _run(
        lambda *a, **k: _torch_only(target_logprobs, *a, **k), logits, targets, shard, w_lp, w_h
    )
    for got, want in zip(kernel, chunked, strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_top_k_equals_the_unfused_top_k(group, dtype) -> None:
    """The kernel (k up to MAX_TOP_K) and the torch selection (forced, and past MAX_TOP_K)."""
    shard, logits = _padded_logits(group, dtype)
    vocab = _VOCAB
    lse = torch.logsumexp(logits[:, :vocab].float(), dim=-1, keepdim=True)
    for k in (1, 20, vocab_kernels.MAX_TOP_K, 100):
        _, want = top_k_unfused(logits, k, shard)
        for path in (top_k, lambda *a, **kw: _torch_only(top_k, *a, **kw)):
            ids, values = path(logits, k, shard, rows=128)  # several chunks
            torch.testing.assert_close(values, want, rtol=0, atol=1e-4, msg=f"k={k}")
            assert bool((ids < vocab).all())
            # Each id carries its own log-probability (ties may come in another order).
            got = logits.float().gather(1, ids) - lse
            torch.testing.assert_close(got, values, rtol=0, atol=1e-4, msg=f"k={k}")


def _torch_only(path, *args, **kwargs):
    usable = vocab_kernels.usable
    vocab_kernels.usable = lambda _: False
    try:
        return path(*args, **kwargs)
    finally:
        vocab_kernels.usable = usable


def test_the_kernels_time_and_memory(group) -> None:
    """Printed for the record, not asserted: 8k positions of a 152k vocabulary in bf16."""
    rows, vocab = 8192, 152_064
    shard = VocabShard(start=0, end=vocab, vocab_size=vocab, tp_group=group, tp_size=1)
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    w = torch.ones(rows, device="cuda")
    for name, path in (
        ("kernels", target_logprobs),
        ("torch chunked", lambda *a, **k: _torch_only(target_logprobs, *a, **k)),
        ("unfused", target_logprobs_unfused),
    ):
        _run(path, logits, targets, shard, w, w)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        _run(path, logits, targets, shard, w, w)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        print(
            f"\n{name}: forward+backward {1e3 * (time.perf_counter() - start):.1f} ms, "
            f"peak {peak:.2f} GiB above the logits"
        )


def test_top_k_time_and_memory(group) -> None:
    """Printed for the record, not asserted: top-20 of 8k positions of a 152k vocabulary."""
    rows, vocab, k = 8192, 152_064, 20
    shard = VocabShard(start=0, end=vocab, vocab_size=vocab, tp_group=group, tp_size=1)
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
    for name, path in (
        ("kernel", top_k),
        ("torch chunked", lambda *a, **kw: _torch_only(top_k, *a, **kw)),
        ("unfused", top_k_unfused),
    ):
        path(logits, k, shard)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        path(logits, k, shard)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        print(
            f"\ntop-{k} {name}: {1e3 * (time.perf_counter() - start):.1f} ms, "
            f"peak {peak:.2f} GiB above the logits"
        )
