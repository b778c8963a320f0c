"""Checking a shard that several receivers read in parts (docs/refit.md, "Checksums").

A receiver checks the checksum of a shard it read whole. A vLLM engine's workers often read a
shard in parts instead (a TP=1 trainer's shard split between two TP=2 workers), so no worker
alone can check it. WSUM-64 (`wsum`) is linear and weights each unit by its index in the shard:
each worker sums the pieces it read, each weighted from where it starts in the shard, and the
sum of the workers' sums, mod 2**64, is the shard's WSUM-64 when their pieces tile it.

Torch-free arithmetic: which reads are partial (`partial_reads`), their sums in host memory
(`host_partial_sums`; device memory: `device_sums`), a worker's contribution to the group's
SUM all-reduce (`contribution`) and what every worker decides from the total (`judge`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from refit_sidecar.core.plan import PullPlan, ShardOrder, ShardReads
from refit_sidecar.core.recent import Recent
from refit_sidecar.integrity.wsum import MASK32, UNIT, SumPlan

LOW_BITS = 32
"""A sum travels as two non-negative int64s of 32 bits each: their SUM over any group of
fewer than 2**31 workers is exact, and the total mod 2**64 is rebuilt from them."""


@dataclass(frozen=True, eq=False)
class PartialSums:
    """The WSUM-64 of each read of a pull that read part of a shard with a published WSUM-64.

    Columns, one row per such read, not a list of records: the group check adds the rows by
    shard position in one array operation, and a model has thousands of them."""

    order: ShardOrder
    """The manifest's shards, in the order every worker of the engine shares."""
    positions: np.ndarray
    """Each read's shard in `order` (int64)."""
    units: np.ndarray
    """Units read (int64)."""
    sums: np.ndarray
    """Their WSUM-64 (uint64)."""
    published: np.ndarray
    """The shard's published WSUM-64 (uint64)."""

    def __len__(self) -> int:
        return len(self.positions)


def partial_reads(plan: PullPlan) -> list[int]:
    """The indices of the reads of part of a shard that carries a WSUM-64 (the plan's, or a
    placeholder saying one will come)."""
    return [
        i
        for i, r in enumerate(plan.reads)
        if not r.complete and r.sum64 is not None and len(r.lengths)
    ]


@dataclass(frozen=True, eq=False)
class PartialLayout:
    """What the partial reads of one layout need every version: their shards' positions and
    their units, and (built when first asked: a device check never does) their host block
    table. A version's plan (`rebase`) keeps its reads' byte arrays, so they say whether a
    layout held is still the plan's."""

    arrays: tuple[np.ndarray, ...]
    """Each read's shard offsets, lengths and destination offsets, in turn (kept alive so
    the identity check cannot meet a reused id)."""
    reads: tuple[ShardReads, ...]
    positions: np.ndarray
    units: np.ndarray

    @functools.cached_property
    def table(self) -> SumPlan:
        reads = self.reads
        if not reads:
            return SumPlan.of([], [], [], [], 0)
        return SumPlan.of(
            np.concatenate([r.dest_offsets for r in reads]),
            np.concatenate([r.lengths for r in reads]),
            np.concatenate([r.shard_offsets for r in reads]),
            np.repeat(np.arange(len(reads)), [len(r.lengths) for r in reads]),
            len(reads),
        )


_layouts = Recent(16)
"""Layouts held: a few receivers' worth of a trainer's slots."""


def _arrays(plan: PullPlan, indices: Sequence[int]) -> tuple[np.ndarray, ...]:
    return tuple(
        a
        for i in indices
        for a in (plan.reads[i].shard_offsets, plan.reads[i].lengths, plan.reads[i].dest_offsets)
    )


def partial_layout(plan: PullPlan, indices: Sequence[int]) -> PartialLayout:
    """`plan`'s partial reads' `PartialLayout`, built once per layout: a plan of many column slices
    has a piece per row, and a version's pull should not lay them out again."""
    order = plan.shard_order
    assert order is not None, "a plan from `plan_pull` knows its manifest's order"
    arrays = _arrays(plan, indices)
    # The layout holds the arrays, so their ids in the key are not reused while it is held.
    key = (id(order), tuple(indices), tuple(id(a) for a in arrays))
    layout: PartialLayout = _layouts.get(key, lambda: _build(plan, indices, arrays))
    return layout


def _build(plan: PullPlan, indices: Sequence[int], arrays: tuple[np.ndarray, ...]) -> PartialLayout:
    reads = tuple(plan.reads[i] for i in indices)
    positions = np.array([r.position for r in reads], np.int64)
    units = np.array([int(r.lengths.sum()) // UNIT for r in reads], np.int64)
    return PartialLayout(arrays, reads, positions, units)


def collect(
    plan: PullPlan,
    indices: Sequence[int],
    values: np.ndarray,
    published: Sequence[int | None] | None = None,
    layout: PartialLayout | None = None,
) -> PartialSums:
    """`values[k]`, the WSUM-64 of `plan.reads[indices[k]]`, as `PartialSums`, against each
    read's published WSUM-64 (`published[i]` for read `i` when they came after the plan);
    reads whose version was published without one are left out (unverified). `layout`: the
    reads' `partial_layout`, where the caller has it already."""
    layout = partial_layout(plan, indices) if layout is None else layout
    assert plan.shard_order is not None
    sums = [plan.reads[i].sum64 if published is None else published[i] for i in indices]
    keep = np.array([value is not None for value in sums], bool)
    expected = np.array([value for value in sums if value is not None], np.uint64)
    return PartialSums(
        plan.shard_order,
        layout.positions[keep],
        layout.units[keep],
        np.asarray(values, np.uint64)[keep],
        expected,
    )


def host_partial_sums(
    plan: PullPlan, dest: np.ndarray, published: Sequence[int | None] | None = None
) -> PartialSums:
    """The WSUM-64s of `plan`'s partial reads landed in host memory `dest`."""
    indices = partial_reads(plan)
    layout = partial_layout(plan, indices)
    return collect(plan, indices, layout.table.host(dest), published, layout)


def contribution(partial: PartialSums) -> np.ndarray:
    """This worker's rows of the group's SUM all-reduce, one column per shard of the manifest
    (int64): units read, then the low and the high 32 bits of its sums."""
    out = np.zeros((3, partial.order.count), np.int64)
    np.add.at(out[0], partial.positions, partial.units)
    np.add.at(out[1], partial.positions, (partial.sums & np.uint64(MASK32)).astype(np.int64))
    np.add.at(out[2], partial.positions, (partial.sums >> np.uint64(LOW_BITS)).astype(np.int64))
    return out


@dataclass(frozen=True)
class Judgement:
    """What one worker finds from the group's total, for the shards it read part of."""

    failed: int | None
    """The first shard position (in `ShardOrder`) whose workers' sum differs from its
    published WSUM-64; None when none does."""
    verified_shards: int
    """This worker's partial reads whose shard the group's pieces covered and matched."""
    verified_bytes: int
    """Their bytes."""


def totals(summed: np.ndarray) -> np.ndarray:
    """The group's WSUM-64 per shard (uint64) from the summed `contribution`s."""
    low, high = summed[1].astype(np.uint64), summed[2].astype(np.uint64)
    with np.errstate(over="ignore"):
        return low + (high << np.uint64(LOW_BITS))


def covered(partial: PartialSums, summed: np.ndarray) -> np.ndarray:
    """Per shard of the manifest: whether the workers' partial reads add up to its every unit
    (the layouts refit plans read a shard's bytes once over an engine's workers, so equal
    counts mean the pieces tile it)."""
    units = summed[0]
    return (units > 0) & (units == partial.order.units)


def judge(partial: PartialSums, summed: np.ndarray) -> Judgement:
    """Compare the group's sum of each shard this worker read part of with its published
    WSUM-64, where the group's pieces cover the shard; the rest stays unverified."""
    whole = covered(partial, summed)[partial.positions]
    got = totals(summed)[partial.positions]
    wrong = whole & (got != partial.published)
    failed = int(partial.positions[wrong].min()) if wrong.any() else None
    bytes_ = int(partial.units[whole].sum()) * UNIT
    return Judgement(failed, int(whole.sum()), bytes_)


def mismatch_message(order: ShardOrder, position: int, summed: np.ndarray, workers: int) -> str:
    """The error every worker raises for the shard at `position`: the same words on each,
    from what all of them hold (the total, the manifest's order)."""
    parameter, shard = order.name(position)
    got = int(totals(summed)[position])
    return (
        f"{parameter} shard {shard} read in parts by {workers} workers: wsum64 {got:#018x} "
        "of their parts != published"
    )
