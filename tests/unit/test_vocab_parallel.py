"""target_logprobs, entropy and top_k at TP size 1 equal torch's log_softmax over the real vocab,
and the chunked path equals the unfused one, gradients included (TP > 1: the trainer's
layout-equivalence tests)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from tests.support.megatron_world import one_rank_group
from trainer_svc.runtime.vocab_parallel import (
    VocabShard,
    chunk_rows,
    target_logprobs,
    target_logprobs_unfused,
    top_k,
    top_k_unfused,
)

VOCAB = 13
PADDED = 16


@pytest.fixture(scope="module")
def tp_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dist.ProcessGroup]:
    """A one-rank gloo world: megatron's reduce needs a real group even at size 1."""
    with one_rank_group(tmp_path_factory.mktemp("gloo") / "rendezvous") as group:
        yield group


def shard_of(group: dist.ProcessGroup, padded: int = PADDED, vocab: int = VOCAB) -> VocabShard:
    return VocabShard(start=0, end=padded, vocab_size=vocab, tp_group=group, tp_size=1)


def logits_with_loud_padding(seed: int = 0, shape: tuple[int, ...] = (3, 5)) -> torch.Tensor:
    """Random logits whose padded columns are the largest: unmasked, they would dominate."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, PADDED, generator=generator, dtype=torch.float64) * 3
    logits[..., VOCAB:] = 50.0
    return logits


def reference_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[..., :VOCAB].double(), dim=-1)


def test_target_logprobs_equal_log_softmax(tp_group: dist.ProcessGroup) -> None:
    logits = logits_with_loud_padding()
    targets = torch.randint(0, VOCAB, logits.shape[:-1], generator=torch.Generator().manual_seed(1))
    logprobs, entropy = target_logprobs(logits, targets, shard_of(tp_group))
    expected = reference_log_softmax(logits).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert entropy is None
    assert logprobs.shape == targets.shape
    assert logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs.double(), expected, rtol=1e-5, atol=1e-5)
    assert (logprobs <= 0).all()


def test_target_logprobs_gradient_equals_log_softmax_gradient(
    tp_group: dist.ProcessGroup,
) -> None:
    logits = logits_with_loud_padding(seed=2).requires_grad_()
    targets = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(3))
    weights = torch.rand(3, 5, generator=torch.Generator().manual_seed(4))
    logprobs, _ = target_logprobs(logits, targets, shard_of(tp_group))
    (logprobs * weights).sum().backward()

    reference = logits.detach()[..., :VOCAB].clone().requires_grad_()
    expected = torch.log_softmax(reference, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (expected * weights.double()).sum().backward()

    assert logits.grad is not None and reference.grad is not None
    assert not logits.grad[..., VOCAB:].any(), "padded columns must get no gradient"
    torch.testing.assert_close(logits.grad[..., :VOCAB], reference.grad, rtol=1e-5, atol=1e-6)


def test_entropy_equals_the_unpadded_distribution_entropy(tp_group: dist.ProcessGroup) -> None:
    logits = logits_with_loud_padding(seed=5)
    targets = torch.zeros(3, 5, dtype=torch.int64)
    logprobs, entropy = target_logprobs(logits, targets, shard_of(tp_group), with_entropy=True)
    reference = reference_log_softmax(logits)
    expected = -(reference.exp() * reference).sum(-1)
    assert entropy is not None
    torch.testing.assert_close(entropy.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logprobs.double(), reference[..., 0], rtol=1e-5, atol=1e-5)


def test_entropy_of_a_uniform_distribution_is_log_vocab(tp_group: dist.ProcessGroup) -> None:
    logits = torch.zeros(2, PADDED)
    logits[:, VOCAB:] = 100.0
    _, entropy = target_logprobs(
        logits, torch.zeros(2, dtype=torch.int64), shard_of(tp_group), with_entropy=True
    )
    assert entropy is not None
    torch.testing.assert_close(entropy, torch.full((2,), float(torch.log(torch.tensor(VOCAB)))))


@pytest.mark.parametrize("k", [1, 4, VOCAB])
def test_top_k_equals_torch_topk_of_log_softmax(tp_group: dist.ProcessGroup, k: int) -> None:
    logits = logits_with_loud_padding(seed=6)
    ids, values = top_k(logits, k, shard_of(tp_group))
    expected_values, expected_ids = reference_log_softmax(logits).topk(k, dim=-1)
    assert ids.shape == values.shape == (3, 5, k)
    assert torch.equal(ids, expected_ids)
    assert (ids < VOCAB).all(), "padding ids must never be proposed"
    torch.testing.assert_close(values.double(), expected_values, rtol=1e-5, atol=1e-5)
    assert (values[..., :-1] >= values[..., 1:]).all(), "best first"


def test_without_padding_results_equal_plain_log_softmax(tp_group: dist.ProcessGroup) -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(7))
    targets = torch.arange(4)
    shard = shard_of(tp_group, padded=VOCAB)
    logprobs, entropy = target_logprobs(logits, targets, shard, with_entropy=True)
    reference = torch.log_softmax(logits, -1)
    torch.testing.assert_close(logprobs, reference[torch.arange(4), targets])
    assert entropy is not None
    torch.testing.assert_close(entropy, -(reference.exp() * reference).sum(-1))
    ids, _ = top_k(logits, 3, shard)
    assert torch.equal(ids, reference.topk(3, -1).indices)


@pytest.mark.parametrize("rows", [1, 4, 1000])
def test_the_chunked_path_equals_the_unfused_one_with_gradients(
    tp_group: dist.ProcessGroup, rows: int
) -> None:
    """Chunks of `rows` positions (one, several with a ragged last one, all at once) give the
    unfused implementation's log-probabilities, entropies, top-k, and gradients of a loss that
    uses both log-probabilities and entropy; padded columns get no gradient."""
    shard = shard_of(tp_group)
    base = logits_with_loud_padding(seed=8, shape=(3, 5)).float()
    targets = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(9))
    w_lp, w_h = (torch.rand(3, 5, generator=torch.Generator().manual_seed(s)) for s in (10, 11))
    results = []
    for fused in (True, False):
        logits = base.clone().requires_grad_()
        if fused:
            logprobs, entropy = target_logprobs(
                logits, targets, shard, with_entropy=True, rows=rows
            )
            ids, values = top_k(logits.detach(), 5, shard, rows=rows)
        else:
            logprobs, entropy = target_logprobs_unfused(logits, targets, shard, with_entropy=True)
            ids, values = top_k_unfused(logits.detach(), 5, shard)
        assert entropy is not None
        ((logprobs * w_lp).sum() + (entropy * w_h).sum()).backward()
        assert logits.grad is not None
        results.append((logprobs, entropy, ids, values, logits.grad))
    (lp, ent, ids, values, grad), (lp0, ent0, ids0, values0, grad0) = results
    torch.testing.assert_close(lp, lp0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent, ent0, rtol=1e-5, atol=1e-6)
    assert torch.equal(ids, ids0)
    torch.testing.assert_close(values, values0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, grad0, rtol=1e-5, atol=1e-6)
    assert not grad[..., VOCAB:].any()
    assert chunk_rows(152_064) == (256 << 20) // (4 * 152_064)
