"""The forward-memory benchmark's comparison of two top-k answers: the same log-probabilities,
and ids that may differ only among tied values (`benchmarks.trainer_step`)."""

from __future__ import annotations

import numpy as np

from benchmarks.trainer_step import same_top_k_up_to_ties

_IDS = np.array([[1, 2, 3], [4, 5, 6]])
_VALUES = np.array([[-1.0, -2.0, -2.0], [-0.5, -1.5, -3.0]])


def test_tied_ids_may_come_in_either_order_or_differ_at_the_kth_place() -> None:
    assert same_top_k_up_to_ties((_IDS, _VALUES), (_IDS, _VALUES))
    swapped = np.array([[1, 3, 2], [4, 5, 6]])
    assert same_top_k_up_to_ties((_IDS, _VALUES), (swapped, _VALUES))
    other_at_the_boundary = np.array([[1, 2, 9], [4, 5, 7]])
    assert same_top_k_up_to_ties((_IDS, _VALUES), (other_at_the_boundary, _VALUES))


def test_a_different_id_for_an_untied_value_or_a_different_value_is_a_mismatch() -> None:
    best_changed = np.array([[2, 1, 3], [4, 5, 6]])
    assert not same_top_k_up_to_ties((_IDS, _VALUES), (best_changed, _VALUES))
    assert not same_top_k_up_to_ties((_IDS, _VALUES), (_IDS, _VALUES + 1e-3))
