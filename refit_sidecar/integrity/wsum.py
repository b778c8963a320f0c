"""WSUM-64: the shard checksum a GPU computes in one pass over the bytes (docs/refit.md).

A shard's bytes (an even number of them) are read as little-endian 16-bit units ``u[j]``; unit
``j`` has the 32-bit weight ``w[j] = mix(j) | 1``, where ``mix`` hashes the unit's index in the
shard (its high 32 bits folded into the low, then two rounds of multiply and xor-shift in
32-bit arithmetic, `weights`); the checksum is

    WSUM-64 = sum_j u[j] * w[j]   (mod 2**64).

32-bit arithmetic keeps the kernel near the GPU's memory bandwidth (64-bit multiplies cost
several instructions each); each product still fits 48 bits, summed mod 2**64.

What it is for, like the CRC-32 of host slots: torn, misplaced or corrupted reads, not tampering.

- A change to any one unit (so to any one byte) is always detected: it moves the sum by
  ``d * w[j]`` with ``0 < |d| < 2**16`` and ``w[j]`` odd, which is never a multiple of 2**64.
- Bytes read to the wrong place or in the wrong order meet other weights, so they change the
  sum unless the weights happen to cancel (of the order of 2**-32 per change, as for CRC-32).
- It is linear in the data and each unit's weight depends only on its index, so a shard that
  lands in a destination in several pieces is checked by summing the pieces, each with the
  index where it starts in the shard, in any order and on any device: integer addition mod
  2**64 is associative, so a GPU's block-wise reduction gives exactly the host's value.

This module is the specification: a NumPy reference (`wsum64`), a faster host implementation
(`host_wsum64`, what a receiver staging in host memory verifies with) and
the block table the device kernels read (`SumPlan`). `device_sums` computes the same value on a
GPU (a Triton kernel) or a CPU tensor (torch), and a test holds them all to the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike

FOLD = 0x27D4EB2F
"""Multiplies the index's high 32 bits before they are folded into the low."""
SEED = 0x243F6A88
"""Added to the folded index before mixing (so index 0 gets no special weight)."""
K1 = 0x9E3779B1
K2 = 0x85EBCA77
SHIFT1 = 16
SHIFT2 = 13
MASK32 = (1 << 32) - 1
MASK64 = (1 << 64) - 1
UNIT = 2
"""Bytes per unit: every shard dtype (float32, bfloat16, float16) is a whole number of them."""
BLOCK = 16384
"""Units summed by one block of the device kernel (32 KiB: the fastest of 16, 32 and 64 KiB
over a whole slot; tests/gpu/test_wsum_gpu.py prints the three)."""

_HOST_CHUNK = 1 << 22
"""Units per NumPy pass, to bound the reference's temporary memory."""


def weights(index: np.ndarray) -> np.ndarray:
    """``w[j]`` for an array of unit indices (as uint64 holding 32-bit values)."""
    j = index.astype(np.uint64)
    mask = np.uint64(MASK32)
    z = (j & mask) ^ (((j >> np.uint64(32)) * np.uint64(FOLD)) & mask)
    z = ((z + np.uint64(SEED)) * np.uint64(K1)) & mask
    z ^= z >> np.uint64(SHIFT1)
    z = (z * np.uint64(K2)) & mask
    z ^= z >> np.uint64(SHIFT2)
    return z | np.uint64(1)


def wsum64(data: np.ndarray | bytes, start_unit: int = 0) -> int:
    """WSUM-64 of `data`'s bytes as the units of a shard starting at unit `start_unit` (0 for a
    whole shard): the reference every implementation must equal."""
    raw = np.frombuffer(data, np.uint8) if isinstance(data, bytes) else data
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if raw.size % UNIT:
        raise ValueError(f"WSUM-64 needs an even number of bytes, got {raw.size}")
    units = raw.view("<u2")
    total = np.uint64(0)
    with np.errstate(over="ignore"):
        for begin in range(0, units.size, _HOST_CHUNK):
            part = units[begin : begin + _HOST_CHUNK].astype(np.uint64)
            index = np.arange(begin, begin + part.size, dtype=np.uint64) + np.uint64(start_unit)
            total += (part * weights(index)).sum(dtype=np.uint64)
    return int(total) & MASK64


_FAST_CHUNK = 1 << 16
"""Units per pass of `host_wsum64`: its temporaries stay in the CPU's caches."""


def host_wsum64(data: np.ndarray | bytes, start_unit: int = 0) -> int:
    """`wsum64` computed for speed on the host: the weights in 32-bit arithmetic, in place, over
    cache-sized passes. What a receiver staging in host memory checks a device slot's shards
    with."""
    raw = np.frombuffer(data, np.uint8) if isinstance(data, bytes) else data
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if raw.size % UNIT:
        raise ValueError(f"WSUM-64 needs an even number of bytes, got {raw.size}")
    units = raw.view("<u2")
    if start_unit + units.size <= 1 << 32:
        return _low_wsum64(units, start_unit)
    offsets = np.arange(min(units.size, _FAST_CHUNK), dtype=np.uint64)
    total = np.uint64(0)
    with np.errstate(over="ignore"):
        for begin in range(0, units.size, _FAST_CHUNK):
            part = units[begin : begin + _FAST_CHUNK]
            z = _weights32(offsets[: part.size] + np.uint64(start_unit + begin))
            total += np.dot(part.astype(np.uint64), z.astype(np.uint64))
    return int(total) & MASK64


def _low_wsum64(units: np.ndarray, start_unit: int) -> int:
    """`host_wsum64` of units whose indices all lie below 2**32 (every shard under 8 GiB): an
    index's high bits fold in nothing, so the weights are computed from 32-bit indices, into
    buffers allocated once, with no temporaries."""
    size = min(units.size, _FAST_CHUNK)
    offsets = np.arange(size, dtype=np.uint32)
    z, shifted = np.empty(size, np.uint32), np.empty(size, np.uint32)
    wide_units, wide_weights = np.empty(size, np.uint64), np.empty(size, np.uint64)
    total = np.uint64(0)
    with np.errstate(over="ignore"):
        for begin in range(0, units.size, _FAST_CHUNK):
            part = units[begin : begin + _FAST_CHUNK]
            n = part.size
            w, t = z[:n], shifted[:n]
            np.add(offsets[:n], np.uint32(start_unit + begin), out=w)
            np.add(w, np.uint32(SEED), out=w)
            np.multiply(w, np.uint32(K1), out=w)
            np.right_shift(w, np.uint32(SHIFT1), out=t)
            np.bitwise_xor(w, t, out=w)
            np.multiply(w, np.uint32(K2), out=w)
            np.right_shift(w, np.uint32(SHIFT2), out=t)
            np.bitwise_xor(w, t, out=w)
            np.bitwise_or(w, np.uint32(1), out=w)
            wide_units[:n] = part
            wide_weights[:n] = w
            total += np.dot(wide_units[:n], wide_weights[:n])
    return int(total) & MASK64


def _weights32(index: np.ndarray) -> np.ndarray:
    """`weights` of uint64 unit indices in 32-bit arithmetic, in place (uint32)."""
    z = (index & np.uint64(MASK32)).astype(np.uint32)
    high = (index >> np.uint64(32)).astype(np.uint32)
    high *= np.uint32(FOLD)
    z ^= high
    z += np.uint32(SEED)
    z *= np.uint32(K1)
    z ^= z >> np.uint32(SHIFT1)
    z *= np.uint32(K2)
    z ^= z >> np.uint32(SHIFT2)
    z |= np.uint32(1)
    return z


_BATCH_UNITS = 1 << 15
"""Units per vectorised pass of `SumPlan.host` (at least a block): its temporaries stay in the
CPU's caches, as `host_wsum64`'s do."""

_LONG_RUN_UNITS = 4 * BLOCK
"""A run of blocks at least this long goes to `host_wsum64` whole: its passes beat gathering
units by index, which pays only for pieces too short to call it per piece."""


@dataclass(frozen=True, eq=False)
class SumPlan:
    """Which bytes of a buffer to sum into which checksum, cut into the device kernel's blocks.

    Built from pieces (byte offset in the buffer, byte length, byte offset in its shard, shard
    number): ``blocks`` holds one row per block, (first unit in the buffer, units, index in the
    shard of its first unit); ``groups`` the shard number of each block; ``count`` how many
    checksums come out."""

    blocks: np.ndarray
    groups: np.ndarray
    count: int
    _long: tuple[tuple[int, int, int, int], ...] = field(init=False, repr=False)
    """(first unit, units, shard index, group) of each run of blocks `host` sums whole."""
    _short: tuple[np.ndarray, np.ndarray] = field(init=False, repr=False)
    """The blocks (and their groups) `host` gathers."""

    def __post_init__(self) -> None:
        # Split once per plan (plans are kept per layout), not per sum: arrays allocated
        # beside the gather's temporaries slowed its passes by half in measurements.
        run, sizes = self._runs()
        long = sizes >= _LONG_RUN_UNITS
        runs = np.flatnonzero(long)
        firsts = np.searchsorted(run, runs)
        spans = tuple(
            (int(self.blocks[i, 0]), size, int(self.blocks[i, 2]), int(self.groups[i]))
            for size, i in zip(sizes[runs].tolist(), firsts.tolist(), strict=True)
        )
        short = (self.blocks, self.groups)
        if spans:
            kept = ~long[run]
            short = (self.blocks[kept], self.groups[kept])
        object.__setattr__(self, "_long", spans)
        object.__setattr__(self, "_short", short)

    @classmethod
    def of(
        cls,
        offsets: ArrayLike,
        lengths: ArrayLike,
        shard_offsets: ArrayLike,
        groups: ArrayLike,
        count: int,
    ) -> SumPlan:
        offsets, lengths, shard_offsets, groups = (
            np.asarray(a, dtype=np.int64).reshape(-1)
            for a in (offsets, lengths, shard_offsets, groups)
        )
        if not len(offsets) == len(lengths) == len(shard_offsets) == len(groups):
            raise ValueError("every piece needs an offset, a length, a shard offset and a group")
        if np.any((offsets | lengths | shard_offsets) % UNIT) or np.any(lengths < 0):
            raise ValueError("WSUM-64 pieces start and end on even bytes")
        if len(groups) and (groups.min() < 0 or groups.max() >= count):
            raise ValueError(f"group numbers must lie in [0, {count})")
        units = lengths // UNIT
        per_piece = -(-units // BLOCK)
        owner = np.repeat(np.arange(len(units)), per_piece)
        first = np.repeat(np.cumsum(per_piece) - per_piece, per_piece)
        step = (np.arange(int(per_piece.sum()), dtype=np.int64) - first) * BLOCK
        blocks = np.stack(
            [
                offsets[owner] // UNIT + step,
                np.minimum(units[owner] - step, BLOCK),
                shard_offsets[owner] // UNIT + step,
            ],
            axis=1,
        )
        return cls(np.ascontiguousarray(blocks, dtype=np.int64), groups[owner].copy(), count)

    @property
    def nbytes(self) -> int:
        """Bytes summed."""
        return int(self.blocks[:, 1].sum()) * UNIT if len(self.blocks) else 0

    def host(self, buffer: np.ndarray) -> np.ndarray:
        """The plan's checksums over a host buffer (uint64, one per group), equal to
        `reference`. A long run of blocks (a piece of at least `_LONG_RUN_UNITS`) goes through
        `host_wsum64` in one call; the short ones are gathered in NumPy passes over batches of
        blocks, so a plan of many short pieces (a column slice is a piece per row) costs a few
        array operations per batch, not a Python call per piece."""
        raw = np.ascontiguousarray(buffer).reshape(-1).view(np.uint8)
        units = raw[: raw.size - raw.size % UNIT].view("<u2")
        out = np.zeros(self.count, dtype=np.uint64)
        for first, size, index, group in self._long:
            data = raw[first * UNIT : (first + size) * UNIT]
            out[group] = np.uint64((int(out[group]) + host_wsum64(data, index)) & MASK64)
        self._gather(units, *self._short, out)
        return out

    def _runs(self) -> tuple[np.ndarray, np.ndarray]:
        """Each block's run (consecutive blocks continuing one another in the buffer and the
        shard, of one group) and each run's units."""
        first, count, index = self.blocks[:, 0], self.blocks[:, 1], self.blocks[:, 2]
        if not len(first):
            return first, first
        goes_on = (
            (first[1:] == first[:-1] + count[:-1])
            & (index[1:] == index[:-1] + count[:-1])
            & (self.groups[1:] == self.groups[:-1])
        )
        run = np.concatenate([[0], np.cumsum(~goes_on)])
        return run, np.bincount(run, weights=count).astype(np.int64)

    @staticmethod
    def _gather(units: np.ndarray, blocks: np.ndarray, groups: np.ndarray, out: np.ndarray) -> None:
        """Adds the checksums of `blocks` into `out` by group, gathering their units in
        batches of about `_BATCH_UNITS`."""
        ends = np.cumsum(blocks[:, 1])
        start = 0
        with np.errstate(over="ignore"):
            while start < len(blocks):
                before = int(ends[start - 1]) if start else 0
                stop = max(int(np.searchsorted(ends, before + _BATCH_UNITS, "right")), start + 1)
                batch = blocks[start:stop]
                counts = batch[:, 1]
                begins = np.cumsum(counts) - counts
                within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(begins, counts)
                data = units[np.repeat(batch[:, 0], counts) + within].astype(np.uint64)
                index = (np.repeat(batch[:, 2], counts) + within).astype(np.uint64)
                terms = data * _weights32(index).astype(np.uint64)
                np.add.at(out, groups[start:stop], np.add.reduceat(terms, begins))
                start = stop

    def reference(self, buffer: np.ndarray) -> np.ndarray:
        """The plan's checksums over a host buffer, from `wsum64` (uint64, one per group)."""
        units = np.ascontiguousarray(buffer).reshape(-1).view(np.uint8)
        out = np.zeros(self.count, dtype=np.uint64)
        with np.errstate(over="ignore"):
            for (first, count, index), group in zip(self.blocks, self.groups, strict=True):
                begin = int(first) * UNIT
                data = units[begin : begin + int(count) * UNIT]
                out[group] += np.uint64(wsum64(data, int(index)))
        return out
