"""Shards read in parts (refit_sidecar/integrity/partial_sums.py): each receiver's WSUM-64 of
its pieces, on the host (NumPy, vectorised) and where a torch tensor is (the device path, on a
CPU tensor), held to the `wsum64` reference; two receivers' sums added as the engine's workers
add them, matching the published WSUM-64 where their pieces tile a shard, unverified where
they do not (a padded vocabulary's last row), and failing on both when one byte changed."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from refit_sidecar.core.manifest import MemType
from refit_sidecar.core.plan import PullPlan, plan_pull, rebase
from refit_sidecar.integrity import wsum
from refit_sidecar.integrity.device_sums import device_partial_sums
from refit_sidecar.integrity.partial_sums import (
    PartialSums,
    contribution,
    covered,
    host_partial_sums,
    judge,
    mismatch_message,
)
from refit_sidecar.integrity.verify import unverified_bytes
from refit_sidecar.pull.running_check import RunningCheck
from tests.support.partial_reads import SHAPES, by_shard, pull_half, source_slot, wants


def test_the_host_sum_of_many_pieces_equals_the_reference() -> None:
    """`SumPlan.host` (the vectorised path) against `SumPlan.reference`: pieces of one unit,
    pieces longer than a kernel block, pieces far into a shard (high index bits)."""
    rng = np.random.default_rng(1)
    buffer = rng.integers(0, 256, 3 * wsum.BLOCK * 2 + 4096, dtype=np.uint8)
    lengths = [2, 2 * wsum.BLOCK + 6, 64, 2 * wsum.BLOCK, 10, 126]
    offsets = np.cumsum([0, *lengths[:-1]]) + 16
    shard_offsets = [0, 6, 1 << 33, 2 * wsum.BLOCK + 12, 4, 1 << 40]
    groups = [0, 1, 1, 2, 0, 2]
    plan = wsum.SumPlan.of(offsets, lengths, shard_offsets, groups, 3)
    assert np.array_equal(plan.host(buffer), plan.reference(buffer))
    many = wsum.SumPlan.of(
        np.arange(0, 4000, 4), np.full(1000, 2), np.arange(1000) * 6, np.zeros(1000), 1
    )
    assert np.array_equal(many.host(buffer), many.reference(buffer))
    # Long pieces (whole runs through `host_wsum64`) beside short ones, two of them adjacent
    # in the buffer but of different groups, one far into its shard.
    big = rng.integers(0, 256, 12 * wsum.BLOCK * 2, dtype=np.uint8)
    sizes = [5 * wsum.BLOCK * 2, 4 * wsum.BLOCK * 2 - 2, 100, 2 * wsum.BLOCK * 2]
    long = wsum.SumPlan.of(np.cumsum([0, *sizes[:-1]]), sizes, [0, 1 << 34, 8, 2], [0, 1, 1, 0], 2)
    assert np.array_equal(long.host(big), long.reference(big))


def test_a_column_half_sums_to_its_pieces_at_their_shard_offsets() -> None:
    """A worker's partial sum of a column slice (one read per row) equals `wsum64` of each
    row's bytes at its unit index in the shard, added up; the device path agrees."""
    manifest, buffers = source_slot()
    plan, staging, region, stats = pull_half(manifest, buffers, worker=1)
    partial = stats.partial_sums
    assert partial is not None
    names = by_shard(partial)
    assert set(names) == {("row_parallel", 0), ("column_parallel", 0), ("vocab", 0)}
    rows = buffers["row_parallel"].reshape(64, 96 * 2)
    expected = 0
    for row in range(64):
        expected += wsum.wsum64(rows[row, 96:], (row * 96 * 2 + 96) // 2)
    assert names[("row_parallel", 0)][1] == expected & wsum.MASK64
    assert names[("row_parallel", 0)][0] == 64 * 48
    half = buffers["column_parallel"][48 * 64 * 2 :]
    assert names[("column_parallel", 0)][1] == wsum.wsum64(half, 48 * 64)
    device = device_partial_sums(plan, replace(region, mem_type=MemType.VRAM))
    assert np.array_equal(device.sums, partial.sums)
    assert np.array_equal(device.positions, partial.positions)
    assert np.array_equal(host_partial_sums(plan, staging.numpy()).sums, partial.sums)
    # The norm is read whole (checked here); everything else this receiver cannot check alone.
    assert stats.verified_shards == 1
    assert unverified_bytes(plan, region) == int(partial.units.sum()) * wsum.UNIT


def test_a_running_check_sums_the_partial_reads_where_they_land() -> None:
    """The device path of a pull (`RunningCheck` into a CPU tensor described as device
    memory) hands over the same sums as the host path, and still checks the whole reads."""
    manifest, buffers = source_slot()
    plan, _, region, stats = pull_half(manifest, buffers, worker=0)
    device = replace(region, mem_type=MemType.VRAM)
    check = RunningCheck(plan, device, part_bytes=1)
    check.advance(plan.nbytes)
    assert check.finish() == 1
    assert check.partial is not None and stats.partial_sums is not None
    assert np.array_equal(check.partial.sums, stats.partial_sums.sums)
    assert np.array_equal(check.partial.positions, stats.partial_sums.positions)


def _group(parts: list[PartialSums]) -> np.ndarray:
    return np.sum([contribution(p) for p in parts], axis=0)


def test_two_workers_halves_add_up_to_the_published_sum() -> None:
    manifest, buffers = source_slot()
    parts = [pull_half(manifest, buffers, w)[3].partial_sums for w in (0, 1)]
    assert all(isinstance(p, PartialSums) for p in parts)
    summed = _group(parts)
    order = parts[0].order
    whole = covered(parts[0], summed)
    names = {order.name(i)[0] for i in np.flatnonzero(whole)}
    assert names == {"row_parallel", "column_parallel"}  # the vocab's padding row is unread
    for part in parts:
        judged = judge(part, summed)
        assert judged.failed is None and judged.verified_shards == 2
        vocab_units = by_shard(part)[("vocab", 0)][0]
        assert judged.verified_bytes == (int(part.units.sum()) - vocab_units) * wsum.UNIT


@pytest.mark.parametrize("name", ["row_parallel", "column_parallel"])
def test_one_flipped_byte_fails_both_workers_on_the_same_shard(name: str) -> None:
    """A byte of the shard flipped before worker 1 reads it: worker 0's half is right, and
    still both find the shard wrong, with the same message."""
    manifest, buffers = source_slot()
    first = pull_half(manifest, buffers, 0)[3].partial_sums
    buffer = buffers[name]
    # In worker 1's half: a row's second half of columns; the second half of the rows.
    at = 10 * 192 + 150 if name == "row_parallel" else buffer.size * 3 // 4
    buffer[at] ^= 0x40
    second = pull_half(manifest, buffers, 1)[3].partial_sums
    buffer[at] ^= 0x40
    assert first is not None and second is not None
    summed = _group([first, second])
    failed = {judge(p, summed).failed for p in (first, second)}
    (position,) = failed
    assert position is not None and first.order.name(position) == (name, 0)
    message = mismatch_message(first.order, position, summed, 2)
    assert message.startswith(f"{name} shard 0 ") and "wsum64" in message


def test_plans_carry_their_shards_place_in_the_manifest_order() -> None:
    manifest, _ = source_slot()
    plan: PullPlan = plan_pull(manifest, wants(0))
    assert plan.shard_order is not None and plan.shard_order.count == len(SHAPES)
    for reads in plan.reads:
        assert plan.shard_order.name(reads.position) == (reads.parameter, reads.shard)
        assert plan.shard_order.units[reads.position] * 2 == reads.location.nbytes


def test_a_layout_held_serves_only_the_reads_it_was_built_from() -> None:
    """The block tables of a layout's partial reads are held for its later versions (the same
    byte arrays), never for other reads under the same shard order."""
    manifest, buffers = source_slot()
    plan0, staging0, _, stats0 = pull_half(manifest, buffers, 0)
    plan1, staging1, _, stats1 = pull_half(manifest, buffers, 1)
    assert stats0.partial_sums is not None and stats1.partial_sums is not None
    again = host_partial_sums(rebase(plan0, manifest), staging0.numpy())
    assert np.array_equal(again.sums, stats0.partial_sums.sums)
    other = replace(plan1, shard_order=plan0.shard_order)  # same key as plan0's layout
    mixed = host_partial_sums(other, staging1.numpy())
    assert np.array_equal(mixed.sums, stats1.partial_sums.sums)
