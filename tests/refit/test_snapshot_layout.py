"""Snapshot layout: parameters of one storage share a copy; offsets keep their positions;
smaller ranges come first."""

from __future__ import annotations

import pytest

from refit_sidecar.publish.slot_layout import Group, Placement, Region, snapshot_layout


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


def test_a_group_lies_back_to_back_in_member_order_whatever_its_storage_order():
    # Megatron's DDP buffer holds a layer's experts last first, fc1 and fc2 interleaved.
    fc1 = [Placement(f"e{e}.fc1", 3, 1000 - 100 * e + 50, 50) for e in range(3)]
    fc2 = [Placement(f"e{e}.fc2", 3, 1000 - 100 * e, 50) for e in range(3)]
    layout = snapshot_layout(
        [Placement("norm", 9, 0, 8)],
        alignment=64,
        groups=[Group("fc1", tuple(fc1)), Group("fc2", tuple(fc2))],
    )
    assert layout.offsets == {"norm": 0, "fc1": 64, "fc2": 256}
    assert layout.regions == (
        Region(9, 0, 8, 0),
        Region(3, 1050, 1100, 64),
        Region(3, 950, 1000, 114),
        Region(3, 850, 900, 164),
        Region(3, 1000, 1050, 256),
        Region(3, 900, 950, 306),
        Region(3, 800, 850, 356),
    )
    assert layout.nbytes == 448


def test_members_adjacent_in_their_storage_are_one_copy_and_are_never_bridged_over():
    experts = tuple(Placement(f"e{e}", 1, 100 + 40 * e, 40) for e in range(4))
    layout = snapshot_layout(
        [Placement("a", 1, 0, 100), Placement("b", 1, 260, 10)],
        alignment=16,
        groups=[Group("experts", experts)],
    )
    # "a" and "b" are 160 bytes apart, well within max_gap, but the experts lie between.
    assert layout.regions == (
        Region(1, 260, 270, 0),
        Region(1, 0, 100, 16),
        Region(1, 100, 260, 128),
    )
    assert layout.offsets == {"b": 0, "a": 16, "experts": 128}
    with pytest.raises(ValueError, match="overlaps"):
        snapshot_layout(
            [Placement("a", 1, 0, 120)], alignment=16, groups=[Group("experts", experts)]
        )
