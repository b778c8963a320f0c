"""Log-probabilities, entropy and top-k over vocab-parallel logits.

Logits arrive split over TP ranks along the vocab (``[..., V / tp]``). Rows past the HF vocab
(padding) are masked to -inf, so results equal an unpadded model's. The sums that cross ranks use
megatron's ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward),
which keeps the gradients exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region


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


def target_logprobs(
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
def top_k(logits: torch.Tensor, k: int, shard: VocabShard) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely token ids per position and their log-probabilities, best first."""
    parts = _log_softmax_parts(logits, shard)
    local_k = min(k, shard.end - shard.start)
    values, indices = (parts.shifted - parts.lse.unsqueeze(-1)).topk(local_k, dim=-1)
    indices = indices + shard.start
    if shard.tp_size > 1:
        gathered_v = [torch.empty_like(values) for _ in range(shard.tp_size)]
        gathered_i = [torch.empty_like(indices) for _ in range(shard.tp_size)]
        dist.all_gather(gathered_v, values.contiguous(), group=shard.tp_group)
        dist.all_gather(gathered_i, indices.contiguous(), group=shard.tp_group)
        values, order = torch.cat(gathered_v, dim=-1).topk(k, dim=-1)
        indices = torch.cat(gathered_i, dim=-1).gather(-1, order)
    return indices, values
