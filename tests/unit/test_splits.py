"""Layouts a model cannot be split into are named, with their numbers, on both sides: the
trainer (Megatron) and a receiving vLLM engine."""

from __future__ import annotations

import dataclasses

import pytest

from inference_ext.slices import (
    ReceiverLayout,
    UnsupportedLayout,
    check_receiver_layout,
    receiver_layout_problems,
)
from megatron_hf.splits import UnsplittableModel, check_trainer_layout, trainer_layout_problems
from tests.support.specs import synthetic_spec

SPEC = synthetic_spec(num_layers=4, head_dim=32, tie_word_embeddings=True)


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 4), (1, 4)])
def test_splittable_trainer_layouts_have_no_problems(tp, pp):
    assert trainer_layout_problems(SPEC, tensor_parallel=tp, pipeline_parallel=pp) == []
    check_trainer_layout(SPEC, tensor_parallel=tp, pipeline_parallel=pp)


def test_every_trainer_problem_is_named_with_its_numbers():
    spec = dataclasses.replace(SPEC, num_attention_heads=6, num_query_groups=3, ffn_hidden_size=102)
    problems = trainer_layout_problems(spec, tensor_parallel=4, pipeline_parallel=3)
    assert problems == [
        "6 attention heads do not split over tensor parallel 4",
        "3 key/value heads (query groups) do not split over tensor parallel 4",
        "MLP hidden size (intermediate_size) 102 does not split over tensor parallel 4",
        "num_layers (4) must be divisible by pipeline_parallel (3); uneven pipeline splits are "
        "not supported",
    ]
    with pytest.raises(UnsplittableModel, match=r"TP=4 PP=3: 6 attention heads"):
        check_trainer_layout(spec, tensor_parallel=4, pipeline_parallel=3)


def test_mqa_cannot_be_trained_over_two_tensor_parallel_ranks():
    mqa = dataclasses.replace(SPEC, num_query_groups=1)
    assert trainer_layout_problems(mqa, tensor_parallel=2, pipeline_parallel=1) == [
        "1 key/value heads (query groups) do not split over tensor parallel 2"
    ]
    assert trainer_layout_problems(mqa, tensor_parallel=1, pipeline_parallel=2) == []


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_receivers_split_or_replicate_kv_heads(tp):
    assert receiver_layout_problems(SPEC, tp) == []
    assert receiver_layout_problems(dataclasses.replace(SPEC, num_query_groups=1), tp) == []


def test_every_receiver_problem_is_named_with_its_numbers():
    spec = dataclasses.replace(
        SPEC, num_attention_heads=6, num_query_groups=6, ffn_hidden_size=102, vocab_size=101
    )
    assert receiver_layout_problems(spec, 4) == [
        "attention heads (6) does not split over 4 ranks",
        "6 key/value heads do not split over 4 ranks",
        "ffn_hidden_size (102) does not split over 4 ranks",
    ]
    assert receiver_layout_problems(dataclasses.replace(SPEC, num_query_groups=4), 8)[0] == (
        "attention heads (4) does not split over 8 ranks"
    )
    three = dataclasses.replace(SPEC, num_attention_heads=6, num_query_groups=2, ffn_hidden_size=96)
    assert receiver_layout_problems(three, 3) == [
        "3 ranks cannot replicate 2 key/value heads evenly",
        "vocabulary 101 (padded to 128) does not split over 3 ranks",
    ]
    with pytest.raises(UnsupportedLayout, match=r"engine at TP=3: 3 ranks cannot"):
        check_receiver_layout(three, ReceiverLayout(0, 3))
