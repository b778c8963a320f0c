"""Causal attention over a packed row as a few dense batches of similar-length sequences
(`--packed-attention bucketed`).

Why: on Hopper the packed row's variable-length flash kernel does a token's attention work
more slowly than the dense kernel right-padded rows get (cuDNN's), while padded rows compute
padding (BENCHMARKS.md, "Known gaps"). Here the row's sequences are sorted by length and cut
into buckets; each bucket is gathered into one right-padded ``[rows, heads, longest, dim]``
batch and goes through `scaled_dot_product_attention(is_causal=True)`, which is free to pick
its dense kernel, and the outputs are gathered back into the row.

Right padding under a causal mask is exact for the real tokens: a real query attends only
positions at or before its own, all of them its own sequence's. A padding slot holds a copy
of a token of its own sequence (any finite value would do), treated as a constant: the
gather's backward takes each token's gradient from its own slot only, and the scatter's
backward gives padding outputs a zero gradient, so nothing computed at padding reaches a real
token's gradient (a padding query with a zero output gradient adds exactly zero to the key
and value gradients it attended).

Where to cut: a dense causal call over ``rows`` sequences padded to ``longest`` costs about
``rows * longest**2`` of attention work, and each call costs a fixed amount more (its
launches, and a last wave of work blocks that leaves most of the device idle), counted as a
sequence of `CALL_TOKENS` tokens. The cuts minimise the sum exactly over sorted lengths
(`cut`). A bucket's length is rounded up to `LENGTH_MULTIPLE`: the kernels work in tiles of
about that many queries, so the rounding adds next to no work, and it keeps the dense shapes
few from pass to pass (a kernel set up per shape, as cuDNN's is, is then set up less often).

A plan is made on the host once per pass from the lengths the packing already has and
reaches the device with the row (`plan`), so the layers run it with no host round trip.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

CALL_TOKENS = 1024
"""Each dense call is charged as much as attending one more sequence of this many tokens: a
larger value makes fewer, more padded buckets. An estimate from the kernels' shapes (launches
and a part-empty last wave against the work of a 16-head layer), to be tuned with the timings
`tests/gpu/test_bucketed_attention_gpu.py` prints."""

LENGTH_MULTIPLE = 128
"""Bucket lengths are rounded up to a multiple of this (a tile of the dense kernels' queries)."""


def _rounded(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def cut(
    lengths: Sequence[int], call_tokens: int = CALL_TOKENS, multiple: int = LENGTH_MULTIPLE
) -> tuple[tuple[int, ...], ...]:
    """The buckets of sequences (indices into `lengths`), each sorted by length and the buckets
    by their longest, that minimise ``sum(rows * longest**2) + buckets * call_tokens**2``, a
    bucket's longest rounded up to `multiple`.

    A dynamic programme over the distinct rounded lengths in increasing order: a bucket is a
    run of consecutive ones (an optimal bucketing never interleaves lengths, and never splits
    equal ones, which would only add a call). Quadratic in the distinct lengths, each step one
    vectorised minimum."""
    if not lengths:
        return ()
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    rounded = [_rounded(n, multiple) for n in lengths]
    values, counts = np.unique(np.asarray(rounded, dtype=np.int64), return_counts=True)
    before = np.concatenate([[0], np.cumsum(counts)])  # sequences shorter than values[j]
    call = np.int64(call_tokens) ** 2
    best = np.zeros(len(values) + 1, dtype=np.int64)
    start = np.zeros(len(values) + 1, dtype=np.int64)
    for j in range(1, len(values) + 1):
        options = best[:j] + (before[j] - before[:j]) * values[j - 1] ** 2 + call
        start[j] = int(np.argmin(options))
        best[j] = options[start[j]]
    bounds = [len(values)]
    while bounds[-1] > 0:
        bounds.append(int(start[bounds[-1]]))
    edges = [int(before[j]) for j in reversed(bounds)]
    return tuple(tuple(order[a:b]) for a, b in itertools.pairwise(edges))


def cost(
    lengths: Sequence[int],
    buckets: Sequence[Sequence[int]],
    call_tokens: int = CALL_TOKENS,
    multiple: int = LENGTH_MULTIPLE,
) -> int:
    """`cut`'s objective for `buckets` of `lengths`."""
    return sum(
        len(bucket) * _rounded(max(lengths[i] for i in bucket), multiple) ** 2 + call_tokens**2
        for bucket in buckets
    )


@dataclass(frozen=True)
class BucketPlan:
    """Where each token of a packed row lies in the buckets' dense batches, laid end to end as
    one ``[slots, heads, dim]`` tensor (bucket by bucket, each ``[rows, longest]`` row-major)."""

    shapes: tuple[tuple[int, int], ...]
    """(rows, length) of each bucket, in slot order: its length the longest of its sequences,
    rounded up."""
    token_of_slot: torch.Tensor
    """[slots] int64: the row token each slot holds (padding: its sequence's first token)."""
    slot_of_token: torch.Tensor
    """[tokens] int64: the slot of each row token."""


def plan(
    lengths: Sequence[int],
    upload: Callable[[np.ndarray], torch.Tensor] = torch.from_numpy,
    call_tokens: int = CALL_TOKENS,
    multiple: int = LENGTH_MULTIPLE,
) -> BucketPlan:
    """The plan for a packed row of sequences of `lengths` (in row order, each >= 1), its
    index arrays built on the host and handed to `upload` (the packing's copy to the device)."""
    starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    shapes = []
    token_of_slot = []
    slot_of_token = np.empty(int(starts[-1]), dtype=np.int64)
    offset = 0
    for bucket in cut(lengths, call_tokens, multiple):
        mine = np.asarray(lengths, dtype=np.int64)[list(bucket)]
        first = starts[list(bucket)]
        longest = _rounded(int(mine.max()), multiple)
        position = np.arange(longest, dtype=np.int64)[None]
        real = position < mine[:, None]
        tokens = first[:, None] + np.where(real, position, 0)
        slots = offset + np.arange(len(bucket) * longest, dtype=np.int64).reshape(tokens.shape)
        slot_of_token[tokens[real]] = slots[real]
        token_of_slot.append(tokens.reshape(-1))
        shapes.append((len(bucket), longest))
        offset += len(bucket) * longest
    return BucketPlan(
        shapes=tuple(shapes),
        token_of_slot=upload(np.concatenate(token_of_slot)),
        slot_of_token=upload(slot_of_token),
    )


class _ToBuckets(torch.autograd.Function):
    """Row ``[tokens, heads, dim]`` -> one dense ``[rows, longest, heads, dim]`` per bucket.
    Backward: each token's gradient from its own slot only (padding is a constant)."""

    @staticmethod
    def forward(ctx: Any, row: torch.Tensor, plan: BucketPlan) -> tuple[torch.Tensor, ...]:
        ctx.plan = plan
        dense = row.index_select(0, plan.token_of_slot)
        return tuple(_views(dense, plan))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        plan: BucketPlan = ctx.plan
        return _joined(grads, plan).index_select(0, plan.slot_of_token), None


class _FromBuckets(torch.autograd.Function):
    """Each bucket's dense ``[rows, longest, heads, dim]`` output -> the row's tokens.
    Backward: the row's gradient at each token's slot, zero at padding."""

    @staticmethod
    def forward(ctx: Any, plan: BucketPlan, *outputs: torch.Tensor) -> torch.Tensor:
        ctx.plan = plan
        return _joined(outputs, plan).index_select(0, plan.slot_of_token)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan: BucketPlan = ctx.plan
        dense = grad.new_zeros((plan.token_of_slot.shape[0], *grad.shape[1:]))
        dense.index_copy_(0, plan.slot_of_token, grad)
        return (None, *_views(dense, plan))


def _joined(parts: Sequence[torch.Tensor], plan: BucketPlan) -> torch.Tensor:
    """Each bucket's ``[rows, longest, ...]`` end to end as ``[slots, ...]``: one copy, none
    for a single bucket already laid out so."""
    if len(parts) == 1:
        return parts[0].reshape(-1, *parts[0].shape[2:])
    dense = parts[0].new_empty((plan.token_of_slot.shape[0], *parts[0].shape[2:]))
    for view, part in zip(_views(dense, plan), parts, strict=True):
        view.copy_(part)
    return dense


def _views(dense: torch.Tensor, plan: BucketPlan) -> list[torch.Tensor]:
    """``[slots, ...]`` as each bucket's ``[rows, longest, ...]`` (views, no copy)."""
    sizes = [rows * longest for rows, longest in plan.shapes]
    return [
        part.view(rows, longest, *dense.shape[1:])
        for part, (rows, longest) in zip(dense.split(sizes), plan.shapes, strict=True)
    ]


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    buckets: BucketPlan,
    *,
    scale: float | None,
    grouped: bool,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention inside each sequence of a packed row: `query` ``[tokens, heads, dim]``,
    `key` and `value` ``[tokens, groups, dim]`` -> ``[tokens, heads, dim]``. `grouped`: fewer
    key/value groups than heads, passed as is (``enable_gqa``) as the padded rows pass them."""
    dense = [_ToBuckets.apply(x, buckets) for x in (query, key, value)]
    outputs = []
    for q, k, v in zip(*dense, strict=True):
        # [rows, longest, heads, dim] <-> [rows, heads, longest, dim], as views
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            dropout_p=dropout,
            is_causal=True,
            scale=scale,
            enable_gqa=grouped,
        )
        outputs.append(out.transpose(1, 2))
    result = _FromBuckets.apply(buckets, *outputs)
    assert isinstance(result, torch.Tensor)
    return result
