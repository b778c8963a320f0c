"""Snapshot layout: parameters of one storage share a copy; offsets keep their positions;
smaller ranges come first."""

from __future__ import annotations

import pytest

from refit_sidecar.publish.slot_layout import Placement, Region, snapshot_layout


def test_parameters_of_one_buffer_are_one_region_and_keep_their_positions():
    layout = snapshot_layout(
        [
            Placement("b", storage=7, start=128, nbytes=64),
            Placement("a", storage=7, start=0, nbytes=100),  # 28 bytes of padding after it
            Placement("norm", storage=9, start=16, nbytes=8),
        ],
        alignment=256,
    )
    # The smaller range first: the snapshot is copied in slot order, and receivers read each
    # piece of it once it landed.
    assert layout.regions == (Region(9, 16, 24, 0), Region(7, 0, 192, 256))
    assert layout.offsets == {"norm": 0, "a": 256, "b": 384}
    assert layout.nbytes == 512


def test_a_wide_gap_starts_another_region():
    layout = snapshot_layout(
        [Placement("a", 1, 0, 10), Placement("b", 1, 1000, 10)], alignment=64, max_gap=100
    )
    assert layout.regions == (Region(1, 0, 10, 0), Region(1, 1000, 1010, 64))
    assert layout.offsets == {"a": 0, "b": 64}


def test_overlapping_or_repeated_parameters_are_refused():
    with pytest.raises(ValueError, match="overlaps"):
        snapshot_layout([Placement("a", 1, 0, 10), Placement("b", 1, 8, 10)], alignment=64)
    with pytest.raises(ValueError, match="placed once"):
        snapshot_layout([Placement("a", 1, 0, 10), Placement("a", 2, 0, 10)], alignment=64)
    with pytest.raises(ValueError, match="power of two"):
        snapshot_layout([Placement("a", 1, 0, 10)], alignment=48)
