"""A snapshot copy that sums its shards as it goes: one pass over the bytes, not two.

Publishing a version into a device slot copies the rank's parameters into the slot and then
gives each shard's WSUM-64 (`wsum`) to the report. Done apart, the sum reads the whole slot
again after the copy, beside the next training step: publication then moves half as many bytes
again as the device-local copy it is meant to cost. `CopySum` does both in one pass, with the
Triton kernel `wsum_triton.copy_wsum_blocks`: each block of the copy is loaded once from the
parameters, stored into the slot and summed from the same registers.

The copy keeps its pieces (`snapshot_layout.piece_ends`): `copy(i)` queues piece i's blocks on
the current stream, so the slot's words can still be written after each piece. Bytes of a part
that no shard covers (padding a Megatron buffer keeps between parameters) are copied too and
summed into a group that is dropped. `sums()` then adds the blocks' partial sums per shard, on
the device. Parts whose bytes do not start on even addresses cannot be read as 16-bit units;
`CopySum.create` returns None for them, and where Triton cannot run, and the caller copies and
sums apart.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from refit_sidecar import wsum


@dataclass(frozen=True, eq=False)
class _Launch:
    source: torch.Tensor
    """The source storage's bytes as 16-bit units."""
    blocks: torch.Tensor
    """Rows (first unit in the slot, units, index in the shard of the first, first unit in the
    source), on the device."""
    start: int
    """Its first row among the slot's partial sums."""
    whole: bool
    """Every row a whole block, 16-byte aligned in the slot and in the source."""


def _kernel() -> Any:
    try:
        from refit_sidecar import wsum_triton
    except ImportError:
        return None
    return wsum_triton.copy_wsum_blocks


def _units(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage of `tensor` as 16-bit units."""
    storage = tensor.untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return whole.set_(storage, 0, (storage.nbytes() // wsum.UNIT * wsum.UNIT,), (1,)).view(
        torch.int16
    )


def _segments(
    start: int, stop: int, shards: Sequence[tuple[int, int, int]], starts: Sequence[int]
) -> list[tuple[int, int, int, int]]:
    """Bytes [start, stop) of the slot cut where shards begin and end: (offset, length, offset
    in its shard, shard number). `shards` are (offset, bytes, number) sorted by offset,
    `starts` their offsets; bytes no shard covers get number -1 (and offset 0 in it)."""
    out: list[tuple[int, int, int, int]] = []
    at = start
    k = max(0, bisect.bisect_right(starts, at) - 1)
    while at < stop:
        while k < len(shards) and shards[k][0] + shards[k][1] <= at:
            k += 1
        if k < len(shards) and shards[k][0] <= at:
            end = min(stop, shards[k][0] + shards[k][1])
            out.append((at, end - at, at - shards[k][0], shards[k][2]))
        else:
            end = min(stop, shards[k][0]) if k < len(shards) else stop
            out.append((at, end - at, 0, -1))
        at = end
    return out


class CopySum:
    """A slot's snapshot copy in pieces, each block copied and summed in one pass."""

    def __init__(
        self,
        kernel: Any,
        launches: list[list[_Launch]],
        groups: torch.Tensor,
        count: int,
        dest: torch.Tensor,
    ) -> None:
        self._kernel = kernel
        self._launches = launches
        self._groups = groups
        self._count = count
        self._dest = dest
        self._partial = torch.empty(len(groups), dtype=torch.int64, device=dest.device)
        self._sums = torch.zeros(count + 1, dtype=torch.int64, device=dest.device)

    @classmethod
    def create(
        cls,
        dest: torch.Tensor,
        pieces: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
        shards: Sequence[tuple[int, int]],
    ) -> CopySum | None:
        """The copy of `pieces` (per piece, its parts: (slot bytes, parameter bytes), uint8
        views) into `dest` (the slot's bytes, uint8), summing `shards` ((offset in the slot,
        bytes), in the order their sums come out); None where it cannot run (no Triton, or a
        part on odd bytes)."""
        kernel = _kernel()
        if kernel is None:
            return None
        base = dest.data_ptr()
        by_offset = sorted((offset, n, k) for k, (offset, n) in enumerate(shards))
        starts = [offset for offset, _, _ in by_offset]
        launches: list[list[_Launch]] = []
        groups: list[np.ndarray] = []
        rows = 0
        for parts in pieces:
            by_storage: dict[int, tuple[torch.Tensor, list[np.ndarray]]] = {}
            for slot_bytes, source in parts:
                at = slot_bytes.data_ptr() - base
                origin = source.data_ptr() - source.untyped_storage().data_ptr()
                if (at | origin | slot_bytes.numel() | source.data_ptr()) % wsum.UNIT:
                    return None
                cut = np.array(
                    _segments(at, at + slot_bytes.numel(), by_offset, starts), dtype=np.int64
                ).reshape(-1, 4)
                blocks, owner = wsum.cut_blocks(cut[:, 0], cut[:, 1], cut[:, 2])
                # Each row's first source unit: the part's shift between slot and source; and
                # its group, the bytes of no shard in the one past the last.
                source_first = blocks[:, :1] + (origin - at) // wsum.UNIT
                group = np.where(cut[owner, 3] < 0, len(shards), cut[owner, 3])[:, None]
                key = source.untyped_storage().data_ptr()
                entry = by_storage.setdefault(key, (_units(source), []))
                entry[1].append(np.concatenate([blocks, source_first, group], axis=1))
            piece: list[_Launch] = []
            for units, tables in by_storage.values():
                table = np.concatenate(tables)
                whole = (
                    (table[:, 1] == wsum.BLOCK) & (table[:, 0] % 8 == 0) & (table[:, 3] % 8 == 0)
                )
                for kind in (True, False):
                    chosen = table[whole == kind]
                    if len(chosen):
                        rows_of = torch.from_numpy(np.ascontiguousarray(chosen[:, :4]))
                        piece.append(_Launch(units, rows_of.to(dest.device), rows, kind))
                        groups.append(chosen[:, 4])
                        rows += len(chosen)
            launches.append(piece)
        numbers = np.concatenate(groups) if groups else np.zeros(0, np.int64)
        return cls(kernel, launches, torch.from_numpy(numbers).to(dest.device), len(shards), dest)

    @property
    def pieces(self) -> int:
        return len(self._launches)

    def copy(self, piece: int) -> None:
        """Queues piece `piece`'s copy and partial sums on the current stream."""
        units = self._dest.view(torch.int16)
        for launch in self._launches[piece]:
            n = len(launch.blocks)
            self._kernel[(n,)](
                launch.source,
                units,
                launch.blocks,
                self._partial[launch.start : launch.start + n],
                **wsum.TRITON_CONSTANTS,
                FULL=launch.whole,
            )

    def sums(self) -> torch.Tensor:
        """Queues, after every piece's copy, the sum of each shard (int64 holding the uint64
        WSUM-64, in `shards` order) on the current stream; the returned tensor is valid once
        the stream reaches this point, until the next `sums`."""
        self._sums.zero_()
        self._sums.index_add_(0, self._groups, self._partial)
        return self._sums[: self._count]

    def last_sums(self) -> list[int]:
        """The WSUM-64s of the last `sums`, once its stream has passed it (blocking)."""
        values = self._sums[: self._count].cpu().numpy().view(np.uint64)
        return [int(v) for v in values]
