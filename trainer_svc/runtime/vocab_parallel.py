"""Log-probabilities, entropy and top-k over vocab-parallel logits.

Logits arrive split over TP ranks along the vocab (``[..., V / tp]``). Rows past the HF vocab
(padding) are masked to -inf, so results equal an unpadded model's.

`target_logprobs` and `top_k` work through the positions in chunks (`chunk_rows`: about 256 MiB
of float32 per chunk), so full-size float32 logits and their softmax are never materialised: at
a vocabulary of 152k and 16k positions those alone are 9.7 GB each. Per position they keep only
the statistics the results and the gradients need (the max, the log-sum-exp, the expected logit
for the entropy), all-reduced over the TP group once per pass; the backward pass recomputes
each chunk's softmax from the logits and writes the gradient in their dtype:

    d logp(t) / dz_j = [j = t] - p_j,        d H / dz_j = -p_j (z_j - E_p[z]).

Each rank's gradient is its own vocab columns' (the loss is computed alike on every TP rank, as
with megatron's reduce-forward, identity-backward regions).

On a GPU the statistics and the gradient come from Triton kernels (`vocab_kernels`): one
program per position walks its row in blocks, so no float32 chunk is materialised either.

`target_logprobs_unfused` and `top_k_unfused` are the earlier direct implementations over the
whole float32 logits (autograd through megatron's reduce regions): the reference the tests hold
the chunked path to, and the baseline of the memory benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

from trainer_svc.runtime import vocab_kernels


@dataclass(frozen=True)
class VocabShard:
    start: int
    end: int
    vocab_size: int
    """The HF vocab size; ids at or above it are padding."""
    tp_group: object
    tp_size: int


@dataclass
class LogSoftmaxParts:
    shifted: torch.Tensor
    lse: torch.Tensor
    padded: torch.Tensor


def _log_softmax_parts(logits: torch.Tensor, shard: VocabShard) -> LogSoftmaxParts:
    ids = torch.arange(shard.start, shard.end, device=logits.device)
    padded = ids >= shard.vocab_size
    logits = logits.float().masked_fill(padded, float("-inf"))
    with torch.no_grad():
        local_max = logits.max(dim=-1).values
        if shard.tp_size > 1:
            dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=shard.tp_group)
    shifted = logits - local_max.unsqueeze(-1)
    sum_exp = reduce_from_tensor_model_parallel_region(
        shifted.exp().sum(dim=-1), group=shard.tp_group
    )
    return LogSoftmaxParts(shifted=shifted, lse=sum_exp.log(), padded=padded)


def target_logprobs_unfused(
    logits: torch.Tensor, targets: torch.Tensor, shard: VocabShard, *, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) per position (differentiable), and the entropy when asked."""
    parts = _log_softmax_parts(logits, shard)
    local = (targets >= shard.start) & (targets < shard.end)
    index = (targets - shard.start).clamp(0, shard.end - shard.start - 1)
    picked = parts.shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    picked = reduce_from_tensor_model_parallel_region(
        torch.where(local, picked, torch.zeros_like(picked)), group=shard.tp_group
    )
    logprobs = picked - parts.lse
    if not with_entropy:
        return logprobs, None
    probs = (parts.shifted - parts.lse.unsqueeze(-1)).exp()
    # Padded columns have probability 0 and logit -inf; zero the logit first so 0 * -inf never
    # enters the graph (its gradient would be NaN).
    weighted = probs * parts.shifted.masked_fill(parts.padded, 0.0)
    expected = reduce_from_tensor_model_parallel_region(weighted.sum(dim=-1), group=shard.tp_group)
    return logprobs, parts.lse - expected


@torch.no_grad()
def top_k_unfused(
    logits: torch.Tensor, k: int, shard: VocabShard
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely token ids per position and their log-probabilities, best first."""
    parts = _log_softmax_parts(logits, shard)
    local_k = min(k, shard.end - shard.start)
    values, indices = (parts.shifted - parts.lse.unsqueeze(-1)).topk(local_k, dim=-1)
    return _merge_top_k(indices + shard.start, values, k, shard)


def _merge_top_k(
    indices: torch.Tensor, values: torch.Tensor, k: int, shard: VocabShard
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best of every TP rank's own best (global ids), best first."""
    if shard.tp_size == 1:
        return indices, values
    gathered_v = [torch.empty_like(values) for _ in range(shard.tp_size)]
    gathered_i = [torch.empty_like(indices) for _ in range(shard.tp_size)]
    dist.all_gather(gathered_v, values.contiguous(), group=shard.tp_group)
    dist.all_gather(gathered_i, indices.contiguous(), group=shard.tp_group)
    values, order = torch.cat(gathered_v, dim=-1).topk(k, dim=-1)
    return torch.cat(gathered_i, dim=-1).gather(-1, order), values


_CHUNK_BYTES = 256 << 20
"""Float32 bytes of logits handled at once."""


def chunk_rows(vocab_columns: int, chunk_bytes: int = _CHUNK_BYTES) -> int:
    """Positions per chunk for `vocab_columns` columns of float32 logits."""
    return max(1, chunk_bytes // (4 * max(vocab_columns, 1)))


def _padded(shard: VocabShard, device: torch.device) -> torch.Tensor:
    return torch.arange(shard.start, shard.end, device=device) >= shard.vocab_size


def _chunk(flat: torch.Tensor, rows: slice, padded: torch.Tensor) -> torch.Tensor:
    return flat[rows].float().masked_fill(padded, float("-inf"))


def _all_reduce(tensor: torch.Tensor, shard: VocabShard, op: dist.ReduceOp.RedOpType) -> None:
    if shard.tp_size > 1:
        dist.all_reduce(tensor, op=op, group=shard.tp_group)


def _valid_columns(shard: VocabShard) -> int:
    """Columns of this shard inside the real vocab (the rest is padding)."""
    return max(0, min(shard.end, shard.vocab_size) - shard.start)


def _kernel_stats(
    flat: torch.Tensor, targets: torch.Tensor, shard: VocabShard, *, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`_stats` through the Triton kernel: one read of the logits, the ranks' online-softmax
    rows merged with one all-reduce of the max and one of the rescaled sums."""
    stats = vocab_kernels.row_stats(
        flat, targets, shard.start, _valid_columns(shard), entropy=entropy
    )
    peak = stats[:, 0].clone()
    _all_reduce(peak, shard, dist.ReduceOp.MAX)
    factor = (stats[:, 0] - peak).exp()  # a shard of padding only: exp(-inf) = 0
    sums = torch.stack([stats[:, 1] * factor, stats[:, 2] * factor, stats[:, 3]])
    _all_reduce(sums, shard, dist.ReduceOp.SUM)
    lse = peak + sums[0].log()
    return lse, sums[1] / sums[0] if entropy else None, sums[2]


def _stats(
    flat: torch.Tensor,
    targets: torch.Tensor | None,
    shard: VocabShard,
    *,
    entropy: bool,
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per position: the log-sum-exp over the whole vocab, the expected logit (with `entropy`)
    and the target's logit (with `targets`), float32; two passes over the chunks, one
    all-reduce each (on a GPU: the Triton kernel, one pass)."""
    if vocab_kernels.usable(flat):
        # No targets: -1 is in no shard, so the kernel picks nothing.
        nowhere = torch.full((flat.shape[0],), -1, dtype=torch.int64, device=flat.device)
        wanted = targets if targets is not None else nowhere
        lse, expected, picked = _kernel_stats(flat, wanted, shard, entropy=entropy)
        return lse, expected, picked if targets is not None else None
    n = flat.shape[0]
    padded = _padded(shard, flat.device)
    peak = torch.empty(n, dtype=torch.float32, device=flat.device)
    for begin in range(0, n, rows):
        span = slice(begin, begin + rows)
        peak[span] = _chunk(flat, span, padded).max(dim=-1).values
    _all_reduce(peak, shard, dist.ReduceOp.MAX)
    sums = torch.zeros(3, n, dtype=torch.float32, device=flat.device)
    if targets is not None:
        local = (targets >= shard.start) & (targets < shard.end)
        index = (targets - shard.start).clamp(0, shard.end - shard.start - 1)
    for begin in range(0, n, rows):
        span = slice(begin, begin + rows)
        z = _chunk(flat, span, padded)
        e = (z - peak[span, None]).exp()
        sums[0, span] = e.sum(dim=-1)
        if entropy:
            sums[1, span] = (e * z.masked_fill(padded, 0.0)).sum(dim=-1)
        if targets is not None:
            picked = z.gather(-1, index[span, None]).squeeze(-1)
            sums[2, span] = torch.where(local[span], picked, torch.zeros_like(picked))
    _all_reduce(sums, shard, dist.ReduceOp.SUM)
    lse = peak + sums[0].log()
    expected = sums[1] / sums[0] if entropy else None
    return lse, expected, sums[2] if targets is not None else None


class _TargetLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(  # noqa: PLR0917 (autograd passes them positionally)
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        shard: VocabShard,
        entropy: bool,
        rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        flat = logits.reshape(-1, logits.shape[-1]).contiguous()
        flat_targets = targets.reshape(-1).contiguous()
        lse, expected, picked = _stats(flat, flat_targets, shard, entropy=entropy, rows=rows)
        assert picked is not None
        logprobs = picked - lse
        ent = lse - expected if expected is not None else torch.empty(0, device=logits.device)
        ctx.save_for_backward(logits, targets, lse, expected if expected is not None else lse)
        ctx.shard, ctx.entropy, ctx.rows = shard, entropy, rows
        if not entropy:
            ctx.mark_non_differentiable(ent)
            return logprobs.view(targets.shape), ent
        return logprobs.view(targets.shape), ent.view(targets.shape)

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor, None, None, None, None]:
        logits, targets, lse, expected = ctx.saved_tensors
        shard: VocabShard = ctx.shard
        flat = logits.reshape(-1, logits.shape[-1])
        g_lp = grad_logprobs.reshape(-1).float()
        g_h = (
            grad_entropy.reshape(-1).float()
            if ctx.entropy and grad_entropy is not None and grad_entropy.numel()
            else None
        )
        flat_targets = targets.reshape(-1)
        if vocab_kernels.usable(flat):
            grad = vocab_kernels.row_grad(
                flat.contiguous(),
                flat_targets.contiguous(),
                start=shard.start,
                valid=_valid_columns(shard),
                lse=lse,
                expected=expected if g_h is not None else None,
                g_lp=g_lp.contiguous(),
                g_h=g_h.contiguous() if g_h is not None else None,
            )
            return grad.view_as(logits), None, None, None, None
        local = (flat_targets >= shard.start) & (flat_targets < shard.end)
        index = (flat_targets - shard.start).clamp(0, shard.end - shard.start - 1)
        padded = _padded(shard, flat.device)
        grad = torch.empty_like(flat)
        for begin in range(0, flat.shape[0], ctx.rows):
            span = slice(begin, begin + ctx.rows)
            z = _chunk(flat, span, padded)
            p = (z - lse[span, None]).exp()
            g = p * -g_lp[span, None]
            hit = torch.where(local[span], g_lp[span], torch.zeros_like(g_lp[span]))
            g.scatter_add_(-1, index[span, None], hit[:, None])
            if g_h is not None:
                centred = z.masked_fill(padded, 0.0) - expected[span, None]
                g -= p * centred * g_h[span, None]
            grad[span] = g.to(grad.dtype)
        return grad.view_as(logits), None, None, None, None


def target_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    shard: VocabShard,
    *,
    with_entropy: bool = False,
    rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) per position (float32, differentiable), and the entropy when asked
    (differentiable too), chunk by chunk (`rows` positions at a time; default `chunk_rows`)."""
    chunk = rows or chunk_rows(logits.shape[-1])
    logprobs, entropy = _TargetLogprobs.apply(logits, targets, shard, with_entropy, chunk)
    return logprobs, entropy if with_entropy else None


@torch.no_grad()
def top_k(
    logits: torch.Tensor, k: int, shard: VocabShard, *, rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely token ids per position and their log-probabilities, best first,
    chunk by chunk. The selection reads the logits in their own dtype, without a float32
    copy: a row's log-softmax is the row shifted by its log-sum-exp, and a bfloat16 logit's
    float32 value is exact, so the best logits are the best log-probabilities. On a GPU, for
    k up to `vocab_kernels.MAX_TOP_K`, a Triton kernel picks each block's best in one read of
    the row (`vocab_kernels.block_top_k`)."""
    flat = logits.reshape(-1, logits.shape[-1])
    chunk = rows or chunk_rows(flat.shape[-1])
    lse, _, _ = _stats(flat, None, shard, entropy=False, rows=chunk)
    valid = _valid_columns(shard)  # padding is a suffix of the last shard
    local_k = min(k, shard.end - shard.start)  # alike on every rank, for the merge
    chosen = min(local_k, valid)
    values = torch.full(
        (flat.shape[0], local_k), float("-inf"), dtype=torch.float32, device=flat.device
    )
    indices = torch.full((flat.shape[0], local_k), shard.start, device=flat.device)
    kernel = vocab_kernels.usable(flat) and chosen <= vocab_kernels.MAX_TOP_K
    for begin in range(0, flat.shape[0] if chosen else 0, chunk):
        span = slice(begin, begin + chunk)
        if kernel:
            best, columns = vocab_kernels.block_top_k(flat[span], chosen, valid)
        else:
            picked = flat[span, :valid].topk(chosen, dim=-1)
            best, columns = picked.values.float(), picked.indices
        values[span, :chosen] = best - lse[span, None]
        indices[span, :chosen] = columns + shard.start
    indices, values = _merge_top_k(indices, values, k, shard)
    shape = (*logits.shape[:-1], values.shape[-1])
    return indices.view(shape), values.view(shape)
