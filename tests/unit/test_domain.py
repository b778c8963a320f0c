"""SequenceBatch, StepCounts and the validated per-step configs of trainer_svc.domain."""

from __future__ import annotations

import numpy as np
import pytest

from trainer_svc.domain import (
    InvalidArgument,
    LossConfig,
    LossKind,
    Normalization,
    OptimizerOverrides,
    SequenceBatch,
    StepCounts,
)

PER_TOKEN = ("loss_mask", "advantages", "behaviour_logprobs", "reference_logprobs")


def three_sequences() -> SequenceBatch:
    return SequenceBatch.from_lists(
        [[10, 11, 12], [20], [30, 31, 32, 33]],
        loss_mask=[[False, True, True], [False], [False, False, True, False]],
        advantages=[[0.0, 1.0, 2.0], [3.0], [4.0, 5.0, 6.0, 7.0]],
        behaviour_logprobs=[[-0.1, -0.2, -0.3], [-0.4], [-0.5, -0.6, -0.7, -0.8]],
    )


def test_from_lists_flattens_and_types_every_array() -> None:
    batch = three_sequences()
    assert batch.tokens.tolist() == [10, 11, 12, 20, 30, 31, 32, 33]
    assert batch.tokens.dtype == np.int64
    assert batch.offsets.tolist() == [0, 3, 4, 8]
    assert batch.offsets.dtype == np.int64
    assert batch.loss_mask.dtype == np.bool_
    assert batch.loss_mask.tolist() == [False, True, True, False, False, False, True, False]
    assert batch.advantages.dtype == np.float32
    assert batch.advantages.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert batch.behaviour_logprobs.dtype == np.float32
    assert batch.reference_logprobs is None
    assert batch.num_sequences == 3
    assert batch.num_tokens == 8
    assert batch.lengths().tolist() == [3, 1, 4]


def test_from_lists_without_per_token_arrays() -> None:
    batch = SequenceBatch.from_lists([[1, 2], [3]])
    assert all(getattr(batch, name) is None for name in PER_TOKEN)
    assert batch.offsets.tolist() == [0, 2, 3]


def test_per_sequence_inverts_from_lists() -> None:
    batch = three_sequences()
    assert [s.tolist() for s in batch.per_sequence(batch.tokens)] == [
        [10, 11, 12],
        [20],
        [30, 31, 32, 33],
    ]
    rows = batch.per_sequence(batch.advantages)
    assert [r.tolist() for r in rows] == [[0.0, 1.0, 2.0], [3.0], [4.0, 5.0, 6.0, 7.0]]


def test_valid_tokens_per_sequence_counts_the_mask() -> None:
    assert three_sequences().valid_tokens_per_sequence().tolist() == [2, 0, 1]


def test_valid_tokens_per_sequence_without_a_mask_is_zero() -> None:
    batch = SequenceBatch.from_lists([[1, 2], [3, 4, 5]])
    counts = batch.valid_tokens_per_sequence()
    assert counts.tolist() == [0, 0]
    assert counts.dtype == np.int64


@pytest.mark.parametrize("indices", [[2, 0], [1], [0, 1, 2], [2, 2]])
def test_select_takes_the_sequences_in_the_given_order(indices: list[int]) -> None:
    batch = three_sequences()
    sub = batch.select(np.array(indices))
    assert sub.num_sequences == len(indices)
    assert sub.offsets.dtype == np.int64
    for name in ("tokens", "loss_mask", "advantages", "behaviour_logprobs"):
        expected = [batch.per_sequence(getattr(batch, name))[i].tolist() for i in indices]
        assert [r.tolist() for r in sub.per_sequence(getattr(sub, name))] == expected
    assert sub.reference_logprobs is None


def test_select_nothing_is_an_empty_batch() -> None:
    sub = three_sequences().select(np.array([], dtype=np.int64))
    assert sub.num_sequences == 0
    assert sub.num_tokens == 0
    assert sub.offsets.tolist() == [0]
    assert sub.advantages is not None
    assert len(sub.advantages) == 0


def test_select_then_concatenate_round_trips() -> None:
    batch = three_sequences()
    parts = [batch.select(np.array([0])), batch.select(np.array([1, 2]))]
    assert np.array_equal(np.concatenate([p.tokens for p in parts]), batch.tokens)
    assert np.array_equal(np.concatenate([p.loss_mask for p in parts]), batch.loss_mask)


def test_step_counts_plus_accumulates() -> None:
    batch = three_sequences()
    once = StepCounts().plus(batch)
    assert once == StepCounts(microbatches=1, sequences=3, valid_tokens=3, valid_sequences=2)
    twice = once.plus(batch.select(np.array([2])))
    assert twice == StepCounts(microbatches=2, sequences=4, valid_tokens=4, valid_sequences=3)
    assert once == StepCounts(microbatches=1, sequences=3, valid_tokens=3, valid_sequences=2)


def test_step_counts_plus_without_a_mask_counts_no_valid_tokens() -> None:
    counts = StepCounts().plus(SequenceBatch.from_lists([[1, 2], [3, 4]]))
    assert counts == StepCounts(microbatches=1, sequences=2, valid_tokens=0, valid_sequences=0)


def test_loss_config_defaults_and_needs() -> None:
    default = LossConfig()
    assert default.kind is LossKind.CROSS_ENTROPY
    assert default.normalization is Normalization.TOKEN
    assert (default.clip_low, default.clip_high, default.kl_coef) == (0.2, 0.2, 0.0)
    assert not default.needs_policy_inputs
    assert not default.needs_reference
    ppo_kl = LossConfig(kind=LossKind.PPO, kl_coef=0.05)
    assert ppo_kl.needs_policy_inputs
    assert ppo_kl.needs_reference


@pytest.mark.parametrize(
    "kwargs",
    [
        {"clip_low": 0.0},
        {"clip_low": 0.999},
        {"clip_high": 0.0},
        {"clip_high": 10.0},
        {"kl_coef": 0.0},
        {"kl_coef": 3.0},
    ],
)
def test_loss_config_accepts_bounds(kwargs: dict[str, float]) -> None:
    config = LossConfig(**kwargs)
    for name, value in kwargs.items():
        assert getattr(config, name) == value


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"clip_low": -0.1}, r"clip_low must lie in \[0, 1\), got -0.1"),
        ({"clip_low": 1.0}, r"clip_low must lie in \[0, 1\), got 1.0"),
        ({"clip_low": float("nan")}, r"clip_low must lie in \[0, 1\), got nan"),
        ({"clip_high": -0.5}, r"clip_high must be a finite value >= 0, got -0.5"),
        ({"clip_high": float("inf")}, r"clip_high must be a finite value >= 0, got inf"),
        ({"clip_high": float("nan")}, r"clip_high must be a finite value >= 0, got nan"),
        ({"kl_coef": -1.0}, r"kl_coef must be a finite value >= 0, got -1.0"),
        ({"kl_coef": float("inf")}, r"kl_coef must be a finite value >= 0, got inf"),
        ({"kl_coef": float("nan")}, r"kl_coef must be a finite value >= 0, got nan"),
    ],
)
def test_loss_config_rejects(kwargs: dict[str, float], pattern: str) -> None:
    with pytest.raises(InvalidArgument, match=pattern):
        LossConfig(**kwargs)


def test_optimizer_overrides_accept_none_and_valid_values() -> None:
    assert all(v is None for v in vars(OptimizerOverrides()).values())
    overrides = OptimizerOverrides(
        learning_rate=0.0,
        weight_decay=0.1,
        adam_beta1=0.0,
        adam_beta2=0.999,
        adam_eps=1e-12,
        max_grad_norm=0.0,
    )
    assert overrides.learning_rate == 0.0
    assert overrides.adam_eps == 1e-12


OPTIMIZER_FIELDS = (
    "learning_rate",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "max_grad_norm",
)


@pytest.mark.parametrize("name", OPTIMIZER_FIELDS)
@pytest.mark.parametrize("value", [-1e-3, float("nan"), float("inf")])
def test_optimizer_overrides_reject_negative_and_non_finite(name: str, value: float) -> None:
    with pytest.raises(InvalidArgument, match=rf"optimizer\.{name} must be a finite value >= 0"):
        OptimizerOverrides(**{name: value})


@pytest.mark.parametrize("name", ["adam_beta1", "adam_beta2"])
@pytest.mark.parametrize("value", [1.0, 1.5])
def test_optimizer_overrides_reject_betas_of_one_or_more(name: str, value: float) -> None:
    with pytest.raises(InvalidArgument, match=rf"optimizer\.{name} must be < 1, got {value}"):
        OptimizerOverrides(**{name: value})


def test_optimizer_overrides_reject_zero_eps() -> None:
    with pytest.raises(InvalidArgument, match=r"optimizer\.adam_eps must be > 0"):
        OptimizerOverrides(adam_eps=0.0)
