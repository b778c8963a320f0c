"""Cutting a source's reads into chunks (`refit_sidecar/pull/chunking.py`)."""

from __future__ import annotations

import numpy as np
import pytest

from refit_sidecar.pull.chunking import chunk_bounds, cut_at, merge_continuing


def test_plain_chunks_are_every_size_bytes_and_a_taper_halves_them_towards_both_ends() -> None:
    assert chunk_bounds(1000, 256).tolist() == [256, 512, 768]
    assert chunk_bounds(256, 256).tolist() == []
    # Taper 2: 64, 64, 128 at the head and 128, 64, 64 at the tail; whole chunks between.
    bounds = chunk_bounds(1000, 256, 2)
    sizes = np.diff(np.concatenate([[0], bounds, [1000]])).tolist()
    assert sizes == [64, 64, 128, 256, 232, 128, 64, 64]
    # Shorter than both ends together: the tapers overlap, every chunk still within size.
    for total in (1, 63, 300, 511, 513):
        cuts = np.concatenate([[0], chunk_bounds(total, 256, 3), [total]])
        assert (np.diff(cuts) > 0).all() and (np.diff(cuts) <= 256).all(), total
    with pytest.raises(ValueError):
        chunk_bounds(1000, 4, 3)


@pytest.mark.parametrize("taper", [0, 1, 3])
def test_reads_cut_at_the_bounds_cover_the_same_bytes_one_chunk_each(taper: int) -> None:
    rng = np.random.default_rng(taper)
    length = rng.integers(1, 700, 40)
    remote = rng.integers(0, 1 << 40, 40).astype(np.uint64)
    dst = rng.permutation(40).astype(np.int64) * 1024
    bounds = chunk_bounds(int(length.sum()), 256, taper)
    r, n, d, chunk = cut_at(remote, length, dst, bounds)
    assert n.sum() == length.sum() and (n > 0).all()
    # Every piece continues its read in the source and the destination alike.
    owner = np.repeat(
        np.arange(40),
        np.bincount(
            np.searchsorted(np.cumsum(length), np.cumsum(n) - 1, side="right"), minlength=40
        ),
    )
    offset = (r - remote[owner]).astype(np.int64)
    assert (offset == d - dst[owner]).all() and (offset >= 0).all()
    assert (offset + n <= length[owner]).all()
    # Each piece lies inside its chunk, and chunks come in order.
    edges = np.concatenate([[0], bounds, [length.sum()]])
    ends = np.cumsum(n)
    starts = ends - n
    assert (edges[chunk] <= starts).all() and (ends <= edges[chunk + 1]).all()
    assert (np.diff(chunk) >= 0).all() and len(set(chunk.tolist())) == len(bounds) + 1


def test_reads_that_continue_each_other_in_both_memories_become_one_within_a_chunk() -> None:
    remote = np.array([100, 110, 130, 140, 145, 500], np.uint64)
    length = np.array([10, 20, 10, 5, 5, 8])
    dst = np.array([0, 10, 30, 40, 45, 60])
    chunk = np.array([0, 0, 0, 1, 1, 1])
    r, n, d, c = merge_continuing(remote, length, dst, chunk)
    # 100..140 continues in both (one chunk); 140 starts another chunk; 500 jumps in the
    # source, so it stays apart even though the destination had continued.
    assert r.tolist() == [100, 140, 500]
    assert n.tolist() == [40, 10, 8]
    assert d.tolist() == [0, 40, 60]
    assert c.tolist() == [0, 1, 1]
    # A gap on either side keeps reads apart: the bytes between belong to nobody we know.
    gap = merge_continuing(
        np.array([0, 12], np.uint64), np.array([10, 4]), np.array([0, 10]), np.zeros(2, int)
    )
    assert gap[1].tolist() == [10, 4]
