"""Triton kernels for `vocab_parallel` on a GPU: one program per position walks its row of the
rank's vocab shard in blocks, so neither pass holds more than a block of float32 at a time.

- `row_stats`: an online softmax over the row (running max, rescaled sum of exponentials,
  rescaled sum of exponential times logit for the entropy) and the target's logit when the
  target falls in this shard. The caller merges the ranks' rows: the max all-reduced, each
  rank's sums rescaled to it, then summed.
- `row_grad`: the gradient of `w_lp * log p(target) + w_h * H` with respect to the row, from the
  merged log-sum-exp and expected logit, written in the logits' dtype:
  `w_lp * ([j = t] - p_j) - w_h * p_j * (z_j - E_p[z])`; padded columns get exactly 0.
- `block_top_k`: one program per (position, block of the row) picks the block's K best logits
  (K a power of two at or above the k asked for, at most `MAX_TOP_K`) by K rounds of
  arg-max in registers, so the row is read once; the caller keeps the k best of a row's
  candidates (a few per cent of the row) with torch's top-k.

The torch chunked path in `vocab_parallel` computes the same values on the CPU; the GPU tests
hold the kernels to it (`tests/gpu/test_vocab_kernels_gpu.py`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_BLOCK = 2048
"""Vocab columns per block of a row."""


@functools.cache
def kernels() -> Any:
    """(row_stats, row_grad, block_top_k), compiled on first use; None where Triton cannot
    run."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def row_stats(  # noqa: PLR0917
        logits,
        stride,
        cols,
        valid,
        targets,
        start,
        out,
        ENTROPY: tl.constexpr,  # noqa: N803
        BLOCK: tl.constexpr,  # noqa: N803
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * stride
        target = tl.load(targets + row) - start
        peak = tl.full((), float("-inf"), tl.float32)
        total = tl.zeros((), tl.float32)
        weighted = tl.zeros((), tl.float32)
        picked = tl.zeros((), tl.float32)
        for first in range(0, cols, BLOCK):
            offs = first + tl.arange(0, BLOCK)
            mask = offs < valid
            z = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
            new_peak = tl.maximum(peak, tl.max(z, axis=0))
            finite = new_peak > float("-inf")
            scale = tl.where(finite, tl.exp(peak - new_peak), 1.0)
            e = tl.where(mask & finite, tl.exp(z - new_peak), 0.0)
            total = total * scale + tl.sum(e, axis=0)
            if ENTROPY:
                weighted = weighted * scale + tl.sum(tl.where(mask, e * z, 0.0), axis=0)
            picked += tl.sum(tl.where(mask & (offs == target), z, 0.0), axis=0)
            peak = new_peak
        tl.store(out + row * 4, peak)
        tl.store(out + row * 4 + 1, total)
        tl.store(out + row * 4 + 2, weighted)
        tl.store(out + row * 4 + 3, picked)

    @triton.jit
    def row_grad(  # noqa: PLR0917
        logits,
        grad,
        stride,
        cols,
        valid,
        targets,
        start,
        lse,
        expected,
        g_lp,
        g_h,
        ENTROPY: tl.constexpr,  # noqa: N803
        BLOCK: tl.constexpr,  # noqa: N803
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * stride
        target = tl.load(targets + row) - start
        norm = tl.load(lse + row)
        w_lp = tl.load(g_lp + row)
        if ENTROPY:
            mean = tl.load(expected + row)
            w_h = tl.load(g_h + row)
        for first in range(0, cols, BLOCK):
            offs = first + tl.arange(0, BLOCK)
            inside = offs < cols
            mask = offs < valid
            z = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
            p = tl.where(mask, tl.exp(z - norm), 0.0)
            g = tl.where(offs == target, w_lp, 0.0) - p * w_lp
            if ENTROPY:
                g -= p * (tl.where(mask, z, 0.0) - mean) * w_h
            tl.store(grad + row * stride + offs, g.to(grad.dtype.element_ty), mask=inside)

    @triton.jit
    def block_top_k(  # noqa: PLR0917
        logits,
        stride,
        valid,
        blocks,
        out_values,
        out_columns,
        K: tl.constexpr,  # noqa: N803
        BLOCK: tl.constexpr,  # noqa: N803
    ):
        row = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        offs = block * BLOCK + tl.arange(0, BLOCK)
        mask = offs < valid
        z = tl.load(logits + row * stride + offs, mask=mask, other=float("-inf")).to(tl.float32)
        out = (row * blocks + block) * K
        for j in tl.static_range(K):
            best = tl.max(z, axis=0)
            column = tl.min(tl.where(z == best, offs, 2147483647), axis=0)
            tl.store(out_values + out + j, best)
            tl.store(out_columns + out + j, column)
            z = tl.where(offs == column, float("-inf"), z)

    return row_stats, row_grad, block_top_k


def usable(logits: torch.Tensor) -> bool:
    return logits.is_cuda and kernels() is not None


def row_stats(
    flat: torch.Tensor, targets: torch.Tensor, start: int, valid: int, *, entropy: bool
) -> torch.Tensor:
    """[rows, 4] float32: this shard's max, sum of exp(z - max), sum of exp(z - max) * z (with
    `entropy`) and the target's logit (0 when the target is in another shard)."""
    stats_kernel, _, _ = kernels()
    out = torch.empty(flat.shape[0], 4, dtype=torch.float32, device=flat.device)
    if flat.shape[0]:
        stats_kernel[(flat.shape[0],)](
            flat, flat.stride(0), flat.shape[1], valid, targets, start, out,
            ENTROPY=entropy, BLOCK=_BLOCK,
        )  # fmt: skip
    return out


def row_grad(
    flat: torch.Tensor,
    targets: torch.Tensor,
    *,
    start: int,
    valid: int,
    lse: torch.Tensor,
    expected: torch.Tensor | None,
    g_lp: torch.Tensor,
    g_h: torch.Tensor | None,
) -> torch.Tensor:
    """The gradient of the row losses with respect to `flat`, in its dtype."""
    _, grad_kernel, _ = kernels()
    grad = torch.empty_like(flat)
    entropy = g_h is not None and expected is not None
    if flat.shape[0]:
        grad_kernel[(flat.shape[0],)](
            flat, grad, flat.stride(0), flat.shape[1], valid, targets, start, lse,
            expected if entropy else lse, g_lp, g_h if entropy else g_lp,
            ENTROPY=entropy, BLOCK=_BLOCK,
        )  # fmt: skip
    return grad


MAX_TOP_K = 64
"""The largest k `block_top_k` serves; a larger one takes the torch path."""

_TOP_K_BLOCK = 2048


def block_top_k(flat: torch.Tensor, k: int, valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of the first `valid` columns of each row of `flat` ([rows, k] float32
    values, best first, and their int64 columns), from a kernel that reads each row once."""
    assert 1 <= k <= min(MAX_TOP_K, valid)
    _, _, top_kernel = kernels()
    per_block = 1 << (k - 1).bit_length()
    blocks = -(-valid // _TOP_K_BLOCK)
    rows = flat.shape[0]
    values = torch.empty(rows, blocks * per_block, dtype=torch.float32, device=flat.device)
    columns = torch.empty(rows, blocks * per_block, dtype=torch.int32, device=flat.device)
    if rows:
        top_kernel[(rows, blocks)](
            flat, flat.stride(0), valid, blocks, values, columns,
            K=per_block, BLOCK=_TOP_K_BLOCK,
        )  # fmt: skip
    best, where = values.topk(k, dim=-1)
    return best, columns.gather(-1, where).to(torch.int64)
