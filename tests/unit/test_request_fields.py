"""Request checks name the field at fault (what the edge sends as a google.rpc.BadRequest), ids
are bounded, and a batch's digest tells a resent microbatch from new data under a reused id."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from trainer_svc.domain import (
    InvalidArgument,
    LossConfig,
    LossKind,
    OptimizerOverrides,
    SequenceBatch,
)
from trainer_svc.validation import (
    MAX_ID_CHARS,
    BatchLimits,
    check_id,
    check_sequences,
    check_training_batch,
)

LIMITS = BatchLimits(vocab_size=50, max_sequence_length=8, max_tokens=20)
PPO_KL = LossConfig(kind=LossKind.PPO, kl_coef=0.1)


def batch() -> SequenceBatch:
    return SequenceBatch.from_lists(
        [[1, 2, 3], [4, 5, 6, 7]],
        loss_mask=[[False, True, True], [False, True, True, True]],
        advantages=[[0.0, 1.0, -1.0], [0.0, 0.5, 0.5, 2.0]],
        behaviour_logprobs=[[0.0, -1.0, -2.0], [0.0, -0.5, -0.1, -0.2]],
        reference_logprobs=[[0.0, -1.5, -2.5], [0.0, -0.4, -0.3, -0.2]],
    )


def changed(name: str, index: int, value: float) -> SequenceBatch:
    values = getattr(batch(), name).copy()
    values[index] = value
    return dataclasses.replace(batch(), **{name: values})


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (changed("tokens", 0, 50), "sequences.tokens"),
        (changed("offsets", 1, 9), "sequences.offsets"),
        (dataclasses.replace(batch(), offsets=np.array([0], np.int64)), "sequences.offsets"),
        (changed("loss_mask", 0, True), "loss_mask"),
        (dataclasses.replace(batch(), loss_mask=None), "loss_mask"),
        (changed("advantages", 2, math.nan), "advantages"),
        (dataclasses.replace(batch(), advantages=batch().advantages[:-1]), "advantages"),
        (changed("behaviour_logprobs", 2, 0.5), "behaviour_logprobs"),
        (dataclasses.replace(batch(), reference_logprobs=None), "reference_logprobs"),
    ],
)
def test_batch_refusals_name_their_field(bad: SequenceBatch, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        check_training_batch(bad, PPO_KL, LIMITS)
    assert info.value.field == field


def test_size_refusals_name_their_field() -> None:
    small = BatchLimits(vocab_size=50, max_sequence_length=3, max_tokens=20)
    with pytest.raises(InvalidArgument) as info:
        check_sequences(batch(), small)
    assert info.value.field == "sequences.offsets"
    tiny = BatchLimits(vocab_size=50, max_sequence_length=8, max_tokens=5)
    with pytest.raises(InvalidArgument) as info:
        check_sequences(batch(), tiny)
    assert info.value.field == "sequences.tokens"


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: LossConfig(clip_low=1.0), "loss.clip_low"),
        (lambda: LossConfig(clip_high=math.inf), "loss.clip_high"),
        (lambda: LossConfig(kl_coef=math.nan), "loss.kl_coef"),
        (lambda: OptimizerOverrides(learning_rate=-1.0), "optimizer.learning_rate"),
        (lambda: OptimizerOverrides(adam_beta2=1.0), "optimizer.adam_beta2"),
        (lambda: OptimizerOverrides(adam_eps=0.0), "optimizer.adam_eps"),
    ],
)
def test_step_settings_name_their_field(make, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        make()
    assert info.value.field == field


def test_ids_are_not_empty_and_bounded() -> None:
    check_id("s" * MAX_ID_CHARS, "step_id")
    for bad in ("", "s" * (MAX_ID_CHARS + 1)):
        with pytest.raises(InvalidArgument) as info:
            check_id(bad, "request_id")
        assert info.value.field == "request_id"
        assert len(str(info.value)) < 200


def test_digest_is_equal_for_equal_batches_only() -> None:
    assert batch().digest() == batch().digest()
    assert len(batch().digest()) == 16
    different = [
        changed("tokens", 3, 9),
        changed("advantages", 1, 1.5),
        changed("reference_logprobs", 6, -0.25),
        changed("loss_mask", 1, False),
        dataclasses.replace(batch(), behaviour_logprobs=None),
        dataclasses.replace(batch(), offsets=np.array([0, 4, 7], np.int64)),
        dataclasses.replace(batch(), advantages=batch().advantages.astype(np.float64)),
    ]
    digests = {b.digest() for b in different}
    assert len(digests) == len(different) and batch().digest() not in digests
