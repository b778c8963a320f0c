"""split_passes: consecutive groups within the pass budget, counted as the layout computes them
(packed: the tokens; padded: rows times the longest row)."""

from __future__ import annotations

import numpy as np
import pytest

from trainer_svc.runtime.passes import split_passes


def groups(lengths: list[int], budget: int, *, padded: bool = False) -> list[list[int]]:
    return [g.tolist() for g in split_passes(np.array(lengths), budget, padded=padded)]


def test_packed_groups_hold_at_most_the_budgets_tokens() -> None:
    assert groups([11, 6, 19], 20) == [[0, 1], [2]]
    assert groups([4, 4, 4], 12) == [[0, 1, 2]]


def test_padded_groups_count_the_padding() -> None:
    # [10, 2, 2] holds 14 tokens but computes 3 rows of 10: over a budget of 20.
    assert groups([10, 2, 2], 20) == [[0, 1, 2]]
    assert groups([10, 2, 2], 20, padded=True) == [[0, 1], [2]]
    # A short sequence first, then a long one: the long one pads the short one's row.
    assert groups([2, 10, 3], 20, padded=True) == [[0, 1], [2]]
    assert groups([2, 2, 2, 2], 8, padded=True) == [[0, 1, 2, 3]]


@pytest.mark.parametrize("padded", [False, True])
def test_a_sequence_over_the_budget_is_a_pass_of_its_own(padded: bool) -> None:
    assert groups([3, 50, 3], 10, padded=padded) == [[0], [1], [2]]


@pytest.mark.parametrize("seed", range(5))
def test_padded_groups_fit_and_cover_every_sequence_in_order(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, size=30)
    cut = split_passes(lengths, 64, padded=True)
    assert np.concatenate(cut).tolist() == list(range(30))
    for group in cut:
        assert len(group) == 1 or len(group) * int(lengths[group].max()) <= 64


def test_a_budget_under_one_token_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 1 token"):
        split_passes(np.array([3]), 0)
