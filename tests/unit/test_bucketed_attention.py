"""The bucketed attention of packed rows (`runtime/bucketed_attention.py`) on the CPU in float32:
the cut (every sequence in exactly one bucket, buckets contiguous in length, the cost no more
than any other cut's, padding bounded by the call cost it saves), the plan's index maps, and the
attention itself against each sequence's own causal attention, outputs and gradients of the
queries, keys and values to 1e-6 (of the largest value, where that is above 1: float32 sums in
another order), for grouped-query attention, odd lengths, one sequence and
one-token sequences, with buckets cut anywhere from one per length to one for the row."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainer_svc.config import PackedAttention
from trainer_svc.domain import SequenceBatch
from trainer_svc.runtime.bucketed_attention import attend, cost, cut, plan
from trainer_svc.runtime.packing import pack

TOLERANCE = 1e-6


def _every_cut(lengths: list[int]) -> list[tuple[tuple[int, ...], ...]]:
    """Every cut of the sorted sequences into runs (what `cut` chooses among)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    cuts = []
    for mask in itertools.product((False, True), repeat=len(order) - 1):
        edges = [0, *(i + 1 for i, split in enumerate(mask) if split), len(order)]
        cuts.append(tuple(tuple(order[a:b]) for a, b in itertools.pairwise(edges)))
    return cuts


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("call_tokens", [0, 3, 10, 40, 1000])
@pytest.mark.parametrize("multiple", [1, 8])
def test_the_cut_is_a_partition_by_length_with_the_least_cost(
    seed: int, call_tokens: int, multiple: int
) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 60, size=int(rng.integers(1, 10))).tolist()
    buckets = cut(lengths, call_tokens, multiple)
    assert sorted(i for bucket in buckets for i in bucket) == list(range(len(lengths)))
    spans = [(min(lengths[i] for i in b), max(lengths[i] for i in b)) for b in buckets]
    assert all(hi <= lo for (_, hi), (lo, _) in itertools.pairwise(spans))
    best = min(cost(lengths, other, call_tokens, multiple) for other in _every_cut(lengths))
    assert cost(lengths, buckets, call_tokens, multiple) == best
    # No worse than one bucket per sequence: padding work is paid for by calls saved.
    rounded = [-(-n // multiple) * multiple for n in lengths]
    work = sum(len(b) * max(rounded[i] for i in b) ** 2 for b in buckets)
    waste = work - sum(n * n for n in rounded)
    assert 0 <= waste <= (len(lengths) - len(buckets)) * call_tokens**2


def test_the_cut_at_its_extremes() -> None:
    assert cut([]) == ()
    assert cut([7]) == ((0,),)
    # Equal lengths are never split (that would only add a call).
    assert cut([5, 5, 5], call_tokens=0, multiple=1) == ((0, 1, 2),)
    # Free calls: one bucket per distinct length, no padding; costly calls: one bucket.
    assert cut([4, 1, 4, 9], call_tokens=0, multiple=1) == ((1,), (0, 2), (3,))
    assert cut([4, 1, 4, 9], call_tokens=100, multiple=1) == ((1, 0, 2, 3),)
    # Lengths within one multiple are equal to the cut.
    assert cut([4, 1, 4, 9], call_tokens=0, multiple=8) == ((1, 0, 2), (3,))
    assert plan([4, 1, 4, 9], call_tokens=0, multiple=8).shapes == ((3, 8), (1, 16))


def test_the_cut_scales_to_a_large_pass() -> None:
    lengths = np.random.default_rng(0).integers(1, 4097, size=3000).tolist()
    buckets = cut(lengths)
    assert sorted(i for bucket in buckets for i in bucket) == list(range(3000))


@pytest.mark.parametrize("call_tokens", [0, 4, 1000])
@pytest.mark.parametrize("multiple", [1, 4, 128])
def test_the_plan_maps_each_token_to_one_slot_of_its_own_sequence(
    call_tokens: int, multiple: int
) -> None:
    lengths = [3, 1, 7, 2, 7, 5]
    made = plan(lengths, call_tokens=call_tokens, multiple=multiple)
    assert all(longest % multiple == 0 for _, longest in made.shapes)
    token_of_slot, slot_of_token = made.token_of_slot, made.slot_of_token
    assert token_of_slot.dtype == slot_of_token.dtype == torch.int64
    assert len(token_of_slot) == sum(rows * longest for rows, longest in made.shapes)
    assert torch.equal(token_of_slot[slot_of_token], torch.arange(sum(lengths)))
    sequence = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    offset = 0
    for rows, longest in made.shapes:
        grid = token_of_slot[offset : offset + rows * longest].view(rows, longest)
        # A bucket's row is one sequence from its first token on, padding included.
        assert (sequence[grid] == sequence[grid[:, :1]]).all()
        offset += rows * longest


def _per_sequence(q, k, v, lengths, *, scale, grouped):
    """Each sequence's own causal attention, concatenated: the reference."""
    pieces, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start : start + n].transpose(0, 1)[None] for x in (q, k, v))
        out = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=grouped
        )
        pieces.append(out[0].transpose(0, 1))
        start += n
    return torch.cat(pieces)


CASES = {
    "mixed": [9, 23, 2, 1, 16, 31, 5, 23],
    "odd": [3, 17, 5, 11],
    "one sequence": [13],
    "one token": [1],
    "ones": [1, 1, 4],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("groups", [4, 2, 1])
@pytest.mark.parametrize(("call_tokens", "multiple"), [(0, 1), (8, 1), (1000, 1), (8, 16)])
def test_bucketed_attention_equals_each_sequence_attended_alone(
    case: str, groups: int, call_tokens: int, multiple: int
) -> None:
    lengths, heads, dim = CASES[case], 4, 8
    torch.manual_seed(sum(lengths) + groups)
    total = sum(lengths)
    leaves = [torch.randn(total, n, dim, requires_grad=True) for n in (heads, groups, groups)]
    grad = torch.randn(total, heads, dim)
    scale = 0.3 if groups == 2 else None
    results = []
    for run in ("bucketed", "alone"):
        if run == "bucketed":
            made = plan(lengths, call_tokens=call_tokens, multiple=multiple)
            out = attend(*leaves, made, scale=scale, grouped=groups != heads)
        else:
            out = _per_sequence(*leaves, lengths, scale=scale, grouped=groups != heads)
        results.append([out, *torch.autograd.grad(out, leaves, grad)])
    for what, got, want in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        assert got.shape == want.shape, what
        gap = (got - want).abs().max().item()
        size = max(1.0, want.abs().max().item())
        assert gap <= TOLERANCE * size, f"{case}, {groups} groups, {what}: {gap} of {size}"


def test_padding_reaches_no_real_gradient() -> None:
    """The short sequence padded to the long one's length in one bucket, its padding copies of
    its first token: an output gradient on the short sequence alone reaches its own tokens
    only, and just as it does without padding."""
    lengths, heads, dim = [2, 9], 2, 4
    torch.manual_seed(0)
    leaves = [torch.randn(sum(lengths), heads, dim, requires_grad=True) for _ in range(3)]
    grad = torch.zeros(sum(lengths), heads, dim)
    grad[1] = 1.0  # only the short sequence's last output matters
    made = plan(lengths, call_tokens=1000, multiple=1)
    assert made.shapes == ((2, 9),)
    out = attend(*leaves, made, scale=None, grouped=False)
    dq, dk, dv = torch.autograd.grad(out, leaves, grad)
    for g in (dq, dk, dv):
        assert torch.count_nonzero(g[2:]) == 0
    alone = _per_sequence(*leaves, lengths, scale=None, grouped=False)
    want = torch.autograd.grad(alone, leaves, grad)
    for g, w in zip((dq, dk, dv), want, strict=True):
        assert (g - w).abs().max().item() <= TOLERANCE


def test_pack_carries_a_plan_only_for_the_bucketed_attention() -> None:
    batch = SequenceBatch.from_lists([[1, 2, 3, 4], [5, 6], [7], [8, 9, 10]])
    cpu = torch.device("cpu")
    varlen = pack(batch, cpu, packed=True)
    bucketed = pack(batch, cpu, packed=True, attention=PackedAttention.BUCKETED)
    padded = pack(batch, cpu, attention=PackedAttention.BUCKETED)
    assert varlen is not None and varlen.documents is not None
    assert varlen.documents.buckets is None
    assert padded is not None and padded.documents is None
    assert bucketed is not None and bucketed.documents is not None
    buckets = bucketed.documents.buckets
    assert buckets is not None
    # Predicted positions 3, 1, 2 (the one-token sequence has none).
    assert sum(rows * longest for rows, longest in buckets.shapes) >= 6
    assert torch.equal(buckets.token_of_slot[buckets.slot_of_token], torch.arange(6))
