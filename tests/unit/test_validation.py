"""check_sequences / check_training_batch: each rejection names its problem; valid batches pass."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest

from trainer_svc.domain import Correction, InvalidArgument, LossConfig, LossKind, SequenceBatch
from trainer_svc.validation import BatchLimits, check_sequences, check_training_batch

LIMITS = BatchLimits(vocab_size=50, max_sequence_length=8, max_tokens=20)
CE = LossConfig()
CE_KL = LossConfig(kl_coef=0.1)
PPO = LossConfig(kind=LossKind.PPO)
PPO_KL = LossConfig(kind=LossKind.PPO, kl_coef=0.1)
PPO_TIS = LossConfig(kind=LossKind.PPO, correction=Correction.TIS)


def make_batch(loss: LossConfig) -> SequenceBatch:
    """Three sequences (lengths 3, 2, 4; 9 tokens) with everything ``loss`` needs."""
    sequences = [[1, 2, 3], [4, 5], [6, 7, 8, 49]]
    mask = [[False, True, True], [False, True], [False, False, True, True]]
    per_token: dict[str, list[list[float]]] = {}
    if loss.needs_policy_inputs:
        per_token["advantages"] = [[0.0, 1.0, -1.0], [0.0, 0.5], [0.0, 0.0, 2.0, -2.0]]
        per_token["behaviour_logprobs"] = [[0.0, -1.0, -2.0], [0.0, -0.5], [0, 0, -3.0, -0.1]]
    if loss.needs_reference:
        per_token["reference_logprobs"] = [[0.0, -1.5, -2.5], [0.0, -0.4], [0, 0, -2.0, -0.2]]
    if loss.corrects_sampler:
        per_token["sampler_logprobs"] = [[0.0, -1.2, -1.9], [0.0, -0.6], [0, 0, -2.9, -0.3]]
    return SequenceBatch.from_lists(sequences, loss_mask=mask, **per_token)


def replaced(batch: SequenceBatch, **changes: object) -> SequenceBatch:
    return dataclasses.replace(batch, **changes)


def with_value(name: str, index: int, value: float) -> Callable[[SequenceBatch], SequenceBatch]:
    def change(batch: SequenceBatch) -> SequenceBatch:
        values = getattr(batch, name).copy()
        values[index] = value
        return replaced(batch, **{name: values})

    return change


def without(name: str) -> Callable[[SequenceBatch], SequenceBatch]:
    return lambda batch: replaced(batch, **{name: None})


def truncated(name: str) -> Callable[[SequenceBatch], SequenceBatch]:
    return lambda batch: replaced(batch, **{name: getattr(batch, name)[:-1]})


def added(name: str, value: float = -1.0) -> Callable[[SequenceBatch], SequenceBatch]:
    return lambda batch: replaced(
        batch, **{name: np.full(batch.num_tokens, value, dtype=np.float32)}
    )


def ragged(sequences: list[list[int]]) -> SequenceBatch:
    return SequenceBatch.from_lists(sequences)


# (id, batch, message pattern): check_sequences rejections.
SEQUENCE_CASES = [
    (
        "offsets_single_entry",
        SequenceBatch(tokens=np.zeros(0, np.int64), offsets=np.array([0])),
        r"offsets must hold at least two entries",
    ),
    (
        "offsets_not_starting_at_zero",
        SequenceBatch(tokens=np.arange(1, 8), offsets=np.array([1, 4, 7])),
        r"offsets\[0\] must be 0, got 1",
    ),
    (
        "offsets_ending_short",
        SequenceBatch(tokens=np.arange(1, 8), offsets=np.array([0, 3, 6])),
        r"offsets\[-1\] \(6\) must equal the number of tokens \(7\)",
    ),
    (
        "offsets_ending_past_tokens",
        SequenceBatch(tokens=np.arange(1, 8), offsets=np.array([0, 3, 8])),
        r"offsets\[-1\] \(8\) must equal the number of tokens \(7\)",
    ),
    (
        "empty_sequence",
        SequenceBatch(tokens=np.arange(1, 8), offsets=np.array([0, 3, 3, 7])),
        r"increase strictly: sequence 1 has length 0",
    ),
    (
        "decreasing_offsets",
        SequenceBatch(tokens=np.arange(1, 8), offsets=np.array([0, 5, 3, 7])),
        r"increase strictly: sequence 1 has length -2",
    ),
    (
        "negative_token",
        ragged([[1, 2, 3], [4, -1]]),
        r"token id -1 at flat position 4 is outside the vocabulary \[0, 50\)",
    ),
    (
        "token_equal_to_vocab",
        ragged([[1, 2, 50], [4, 5]]),
        r"token id 50 at flat position 2 is outside the vocabulary \[0, 50\)",
    ),
    (
        "token_far_above_vocab",
        ragged([[1, 2], [3, 4, 1000]]),
        r"token id 1000 at flat position 4 is outside the vocabulary",
    ),
    (
        "too_many_tokens",
        ragged([[1] * 7, [2] * 7, [3] * 7]),
        r"holds 21 tokens; this service accepts at most 20",
    ),
    (
        "sequence_longer_than_max",
        ragged([[1, 2], [3] * 9, [4]]),
        r"sequence 1 has 9 tokens; the model accepts at most 8",
    ),
]


@pytest.mark.parametrize(
    ("batch", "pattern"),
    [case[1:] for case in SEQUENCE_CASES],
    ids=[case[0] for case in SEQUENCE_CASES],
)
def test_check_sequences_rejects(batch: SequenceBatch, pattern: str) -> None:
    with pytest.raises(InvalidArgument, match=pattern):
        check_sequences(batch, LIMITS)


@pytest.mark.parametrize(
    ("batch", "pattern"),
    [case[1:] for case in SEQUENCE_CASES],
    ids=[case[0] for case in SEQUENCE_CASES],
)
def test_check_training_batch_runs_the_sequence_checks(batch: SequenceBatch, pattern: str) -> None:
    with_mask = replaced(batch, loss_mask=np.zeros(len(batch.tokens), dtype=bool))
    with pytest.raises(InvalidArgument, match=pattern):
        check_training_batch(with_mask, CE, LIMITS)


def test_check_sequences_accepts_the_limits_themselves() -> None:
    # Exactly max_tokens tokens, a sequence of exactly max_sequence_length, ids 0 and vocab-1.
    batch = ragged([[0] * 8, [49] * 8, [1, 2, 3, 4]])
    assert batch.num_tokens == LIMITS.max_tokens
    check_sequences(batch, LIMITS)


def test_invalid_argument_is_a_value_error() -> None:
    # The servicer maps InvalidArgument to INVALID_ARGUMENT; it must stay a ValueError subtype.
    with pytest.raises(ValueError, match="offsets"):
        check_sequences(SequenceBatch(tokens=np.arange(3), offsets=np.array([0, 2])), LIMITS)


# (id, loss, change to the valid batch, message pattern): check_training_batch rejections.
TRAINING_CASES = [
    ("loss_mask_missing", CE, without("loss_mask"), r"loss_mask is required: one entry per token"),
    (
        "loss_mask_too_short",
        CE,
        truncated("loss_mask"),
        r"loss_mask has 8 entries; it must have one per token \(9\)",
    ),
    (
        "loss_mask_on_first_token",
        CE,
        with_value("loss_mask", 3, True),
        r"loss_mask is set on the first token of sequence 1",
    ),
    (
        "loss_mask_on_very_first_token",
        CE,
        with_value("loss_mask", 0, True),
        r"first token of sequence 0",
    ),
    (
        "advantages_wrong_length",
        PPO,
        truncated("advantages"),
        r"advantages has 8 entries; it must have one per token \(9\)",
    ),
    (
        "behaviour_logprobs_wrong_length",
        PPO,
        truncated("behaviour_logprobs"),
        r"behaviour_logprobs has 8 entries; it must have one per token \(9\)",
    ),
    (
        "reference_logprobs_wrong_length",
        PPO_KL,
        truncated("reference_logprobs"),
        r"reference_logprobs has 8 entries; it must have one per token \(9\)",
    ),
    (
        "advantages_nan",
        PPO,
        with_value("advantages", 4, np.nan),
        r"advantages\[4\] is nan; every entry must be finite",
    ),
    (
        "advantages_inf",
        PPO,
        with_value("advantages", 2, np.inf),
        r"advantages\[2\] is inf; every entry must be finite",
    ),
    (
        "behaviour_logprobs_minus_inf",
        PPO,
        with_value("behaviour_logprobs", 1, -np.inf),
        r"behaviour_logprobs\[1\] is -inf; every entry must be finite",
    ),
    (
        "behaviour_logprobs_nan_outside_mask",
        PPO,
        with_value("behaviour_logprobs", 0, np.nan),
        r"behaviour_logprobs\[0\] is nan",
    ),
    (
        "reference_logprobs_nan",
        CE_KL,
        with_value("reference_logprobs", 8, np.nan),
        r"reference_logprobs\[8\] is nan",
    ),
    (
        "ppo_without_advantages",
        PPO,
        without("advantages"),
        r"advantages is required by loss ppo",
    ),
    (
        "ppo_without_behaviour_logprobs",
        PPO,
        without("behaviour_logprobs"),
        r"behaviour_logprobs is required by loss ppo",
    ),
    (
        "cross_entropy_with_advantages",
        CE,
        added("advantages", 1.0),
        r"advantages was sent but loss cross_entropy \(kl_coef=0.0\) does not use it",
    ),
    (
        "cross_entropy_with_behaviour_logprobs",
        CE,
        added("behaviour_logprobs"),
        r"behaviour_logprobs was sent but loss cross_entropy",
    ),
    (
        "reference_logprobs_without_kl",
        PPO,
        added("reference_logprobs"),
        r"reference_logprobs was sent but loss ppo \(kl_coef=0.0\) does not use it",
    ),
    (
        "kl_without_reference_logprobs_ppo",
        PPO_KL,
        without("reference_logprobs"),
        r"reference_logprobs is required by loss ppo with kl_coef=0.1",
    ),
    (
        "kl_without_reference_logprobs_cross_entropy",
        CE_KL,
        without("reference_logprobs"),
        r"reference_logprobs is required by loss cross_entropy with kl_coef=0.1",
    ),
    (
        "correction_without_sampler_logprobs",
        PPO_TIS,
        without("sampler_logprobs"),
        r"sampler_logprobs is required by loss ppo with correction tis",
    ),
    (
        "sampler_logprobs_without_a_correction",
        PPO,
        added("sampler_logprobs"),
        r"sampler_logprobs was sent but loss ppo \(kl_coef=0.0\) does not use it without a "
        r"correction",
    ),
    (
        "positive_sampler_logprob",
        PPO_TIS,
        with_value("sampler_logprobs", 2, 0.5),
        r"sampler_logprobs must be <= 0 \(log-probabilities\) at masked-in tokens",
    ),
    (
        "positive_behaviour_logprob",
        PPO,
        with_value("behaviour_logprobs", 2, 0.5),
        r"behaviour_logprobs must be <= 0 \(log-probabilities\) at masked-in tokens",
    ),
    (
        "positive_reference_logprob",
        PPO_KL,
        with_value("reference_logprobs", 7, 1e-3),
        r"reference_logprobs must be <= 0",
    ),
]


@pytest.mark.parametrize(
    ("loss", "change", "pattern"),
    [case[1:] for case in TRAINING_CASES],
    ids=[case[0] for case in TRAINING_CASES],
)
def test_check_training_batch_rejects(
    loss: LossConfig, change: Callable[[SequenceBatch], SequenceBatch], pattern: str
) -> None:
    valid = make_batch(loss)
    check_training_batch(valid, loss, LIMITS)  # the unchanged batch is fine
    with pytest.raises(InvalidArgument, match=pattern):
        check_training_batch(change(valid), loss, LIMITS)


@pytest.mark.parametrize(
    "loss", [CE, CE_KL, PPO, PPO_KL, PPO_TIS], ids=["ce", "ce_kl", "ppo", "ppo_kl", "ppo_tis"]
)
def test_valid_batch_passes(loss: LossConfig) -> None:
    batch = make_batch(loss)
    before = {
        name: None if getattr(batch, name) is None else getattr(batch, name).copy()
        for name in ("tokens", "offsets", "loss_mask", "advantages", "behaviour_logprobs")
    }
    check_training_batch(batch, loss, LIMITS)
    for name, value in before.items():
        after = getattr(batch, name)
        assert (value is None and after is None) or np.array_equal(value, after)


def test_a_correction_takes_pi_old_from_the_step_when_behaviour_logprobs_are_absent() -> None:
    batch = replaced(make_batch(PPO_TIS), behaviour_logprobs=None)
    check_training_batch(batch, PPO_TIS, LIMITS)


def test_positive_logprobs_outside_the_mask_are_accepted() -> None:
    # Only masked-in tokens are used, so the <= 0 rule applies there only (flat position 0 is a
    # first token, whose mask entry is always false).
    batch = with_value("behaviour_logprobs", 0, 3.0)(make_batch(PPO))
    assert not batch.loss_mask[0]
    check_training_batch(batch, PPO, LIMITS)


def test_all_masked_out_batch_passes_validation() -> None:
    # Zero valid tokens is legal for one microbatch; FinishTrainStep refuses an all-empty step.
    batch = replaced(make_batch(CE), loss_mask=np.zeros(9, dtype=bool))
    check_training_batch(batch, CE, LIMITS)
