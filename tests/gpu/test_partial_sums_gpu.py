"""Shards read in parts, summed on a GPU (the Triton kernel): a TP=2 worker's halves summed by
`device_partial_sums` and inside `RunningCheck` equal the host's NumPy sums, and the two
workers' sums add up to the shards' published WSUM-64. Over a TP=2 worker's halves of a layout
shaped like the 1B preset it prints what summing them costs against a device copy of the same
bytes. Run on a GPU machine:

    python -m pytest -m gpu tests/gpu/test_partial_sums_gpu.py -s
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from refit_sidecar.core.manifest import Box, DType, MemType, ShardPiece
from refit_sidecar.core.plan import Want, plan_pull
from refit_sidecar.integrity.device_sums import device_partial_sums
from refit_sidecar.integrity.partial_sums import contribution, covered, judge
from refit_sidecar.memory.region import Region
from refit_sidecar.publish.shard_specs import ShardSpec
from refit_sidecar.pull.running_check import RunningCheck
from tests.refit.shards import in_memory_manifest
from tests.support.partial_reads import pull_half, source_slot

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _on_gpu(staging: torch.Tensor) -> Region:
    moved = staging.to("cuda")
    return Region(moved.data_ptr(), moved.numel(), MemType.VRAM, 0, owner=moved)


def test_halves_summed_on_the_gpu_equal_the_host_and_add_up() -> None:
    manifest, buffers = source_slot()
    parts = []
    for worker in (0, 1):
        plan, _, _, stats = pull_half(manifest, buffers, worker)
        host = stats.partial_sums
        assert host is not None
        _, staging, _, _ = pull_half(manifest, buffers, worker)
        region = _on_gpu(staging)
        direct = device_partial_sums(plan, region)
        check = RunningCheck(plan, region, part_bytes=1)
        check.advance(plan.nbytes)
        assert check.finish() == 1  # the norm, read whole
        assert check.partial is not None
        for got in (direct, check.partial):
            assert np.array_equal(got.sums, host.sums)
            assert np.array_equal(got.positions, host.positions)
        parts.append(check.partial)
    summed = contribution(parts[0]) + contribution(parts[1])
    assert int(covered(parts[0], summed).sum()) == 2
    assert all(judge(p, summed).failed is None for p in parts)


def test_what_summing_a_tp2_workers_halves_costs() -> None:
    """A TP=1 trainer's 1B-shaped layers (q/k/v, o, gate/up, down), of which a TP=2 worker
    reads the halves: row halves of the column-parallel weights, column halves (a piece per
    row) of the row-parallel ones."""
    hidden, ffn, layers = 2048, 5632, 18
    shapes = {"qkv": (3072, hidden), "o": (hidden, hidden), "fc1": (2 * ffn, hidden)}
    shapes["fc2"] = (hidden, ffn)
    rng = np.random.default_rng(0)
    placed, wants = [], []
    for layer in range(layers):
        for kind, shape in shapes.items():
            name = f"{layer}.{kind}"
            buffer = np.frombuffer(rng.bytes(int(np.prod(shape)) * 2), np.uint8).copy()
            piece = ShardPiece(Box.full(shape), (0, 0))
            placed.append(
                ("rank-0", ShardSpec(name, shape, DType.BFLOAT16, shape, (piece,)), buffer)
            )
            rows, cols = shape
            half = Box(((0, rows // 2), (0, cols))) if kind in ("qkv", "fc1") else None
            wants.append(Want(name, half or Box(((0, rows), (0, cols // 2)))))
    manifest = in_memory_manifest(1, placed)
    parameters = tuple(
        replace(p, shards=(replace(p.shards[0], sum64=1),)) for p in manifest.parameters
    )
    plan = plan_pull(replace(manifest, parameters=parameters), wants)
    staging = torch.randint(0, 256, (plan.nbytes,), dtype=torch.uint8, device="cuda")
    region = Region(staging.data_ptr(), staging.numel(), MemType.VRAM, 0, owner=staging)
    copy = torch.empty_like(staging)
    for _ in range(3):  # compile, tables on the device
        device_partial_sums(plan, region)
        copy.copy_(staging)
    torch.cuda.synchronize()
    timings = {}
    for name, work in (
        ("partial sums", lambda: device_partial_sums(plan, region)),
        ("device copy", lambda: copy.copy_(staging)),
    ):
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            work()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        timings[name] = best
    reads = sum(len(r.lengths) for r in plan.reads)
    summed, copied = timings["partial sums"], timings["device copy"]
    print(
        f"\n{plan.bytes_read / 2**30:.2f} GiB in {reads} pieces: partial sums "
        f"{1e3 * summed:.2f} ms, device copy {1e3 * copied:.2f} ms ({summed / copied:.1f}x)"
    )
