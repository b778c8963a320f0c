"""The Triton kernels of WSUM-64 (`wsum`): a block's sum, and a block's copy with its sum.

Importing this module imports Triton; `torch_wsum` and `copy_sum` import it where Triton can
run and fall back to torch elsewhere. Each program handles one row of a block table, at most
``BLOCK`` 16-bit units, and writes one partial sum (an int64 holding the uint64 value); the
partial sums are added per shard afterwards, with integer atomics, exact in any order.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _weighted_sum(unit, j, FOLD, SEED, K1, K2, SHIFT1, SHIFT2):  # noqa: N803, PLR0917
    """sum unit * w[j] mod 2**64 over a block's units (masked ones loaded as 0), j their
    indices in the shard: the weights hashed in 32-bit arithmetic, as `wsum.weights`."""
    z = j.to(tl.uint32) ^ ((j >> 32).to(tl.uint32) * FOLD)
    z = (z + SEED) * K1
    z = z ^ (z >> SHIFT1)
    z = z * K2
    z = z ^ (z >> SHIFT2)
    term = unit.to(tl.uint16, bitcast=True).to(tl.uint64) * (z | 1).to(tl.uint64)
    return tl.sum(term, axis=0).to(tl.int64, bitcast=True)


@triton.jit
def wsum_blocks(  # noqa: PLR0917
    buf,
    blocks,
    out,
    FOLD: tl.constexpr,  # noqa: N803
    SEED: tl.constexpr,  # noqa: N803
    K1: tl.constexpr,  # noqa: N803
    K2: tl.constexpr,  # noqa: N803
    SHIFT1: tl.constexpr,  # noqa: N803
    SHIFT2: tl.constexpr,  # noqa: N803
    BLOCK: tl.constexpr,  # noqa: N803
    FULL: tl.constexpr,  # noqa: N803
):
    """Rows of `blocks`: (first unit in `buf`, units, index in the shard of the first)."""
    pid = tl.program_id(0)
    first = tl.load(blocks + 3 * pid)
    index = tl.load(blocks + 3 * pid + 2)
    lane = tl.arange(0, BLOCK)
    if FULL:
        # A whole block starting on 16 bytes: unmasked, vectorised loads.
        first = tl.multiple_of(first, 8)
        unit = tl.load(buf + first + lane)
    else:
        count = tl.load(blocks + 3 * pid + 1)
        unit = tl.load(buf + first + lane, mask=lane < count, other=0)
    tl.store(out + pid, _weighted_sum(unit, index + lane, FOLD, SEED, K1, K2, SHIFT1, SHIFT2))


@triton.jit
def copy_wsum_blocks(  # noqa: PLR0917
    source,
    dest,
    blocks,
    out,
    FOLD: tl.constexpr,  # noqa: N803
    SEED: tl.constexpr,  # noqa: N803
    K1: tl.constexpr,  # noqa: N803
    K2: tl.constexpr,  # noqa: N803
    SHIFT1: tl.constexpr,  # noqa: N803
    SHIFT2: tl.constexpr,  # noqa: N803
    BLOCK: tl.constexpr,  # noqa: N803
    FULL: tl.constexpr,  # noqa: N803
):
    """Rows of `blocks`: (first unit in `dest`, units, index in the shard of the first, first
    unit in `source`): the units are copied and summed from the one load."""
    pid = tl.program_id(0)
    first = tl.load(blocks + 4 * pid)
    index = tl.load(blocks + 4 * pid + 2)
    origin = tl.load(blocks + 4 * pid + 3)
    lane = tl.arange(0, BLOCK)
    if FULL:
        # Whole, and 16-byte aligned at both ends of the copy.
        first = tl.multiple_of(first, 8)
        origin = tl.multiple_of(origin, 8)
        unit = tl.load(source + origin + lane)
        tl.store(dest + first + lane, unit)
    else:
        count = tl.load(blocks + 4 * pid + 1)
        mask = lane < count
        unit = tl.load(source + origin + lane, mask=mask, other=0)
        tl.store(dest + first + lane, unit, mask=mask)
    tl.store(out + pid, _weighted_sum(unit, index + lane, FOLD, SEED, K1, K2, SHIFT1, SHIFT2))
