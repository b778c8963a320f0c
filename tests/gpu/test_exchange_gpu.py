"""`exchange.Exchange` on a GPU (the Triton kernel): the CPU tests' semantics, exchanges queued
behind the current stream's work, and a running check that hands its summed prefixes to the
exchange and then finds a flipped byte: the undo leaves the engine's tensors as they were. It
prints what exchanging a 1B-sized layout costs against a device-local copy. Run on a GPU
machine:

    python -m pytest -m gpu tests/gpu -s
"""

from __future__ import annotations

import pytest
import torch

from inference_ext.exchange import Exchange, _Blocks
from refit_sidecar import wsum
from refit_sidecar.checksum import ChecksumMismatch
from refit_sidecar.manifest import MemType
from refit_sidecar.plan import PullPlan
from refit_sidecar.running_check import RunningCheck
from tests.gpu.test_running_check_gpu import _layout_1b
from tests.inference import test_exchange as on_cpu
from tests.refit import test_running_check as checks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (random bytes as bf16 hold NaNs, which `torch.equal` never finds equal)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _slices(plan: PullPlan, staging: torch.Tensor) -> list[tuple[str, int, torch.Tensor]]:
    """Each whole-tensor read of `plan` as a bf16 view of `staging` (name, end, view)."""
    out = []
    for read in plan.reads:
        start, nbytes = int(read.dest_offsets[0]), int(read.lengths.sum())
        out.append(
            (read.parameter, start + nbytes, staging[start : start + nbytes].view(torch.bfloat16))
        )
    return out


def test_the_kernel_exchanges_and_takes_back_as_on_the_cpu() -> None:
    on_cpu.test_slices_are_exchanged_in_staging_order_as_their_prefix_is_final("cuda")
    on_cpu.test_undo_takes_back_every_exchange_queued("cuda")
    for n in (1, 3, 4097, 1 << 20):  # int16 and int32 views, partial last blocks
        a = torch.randint(-(1 << 15), 1 << 15, (n,), dtype=torch.int16, device="cuda")
        b = torch.randint(-(1 << 15), 1 << 15, (n,), dtype=torch.int16, device="cuda")
        x, y = a.clone(), b.clone()
        exchange = Exchange.of(
            [("a", 2 * n, a.view(torch.bfloat16))], {"a": b.view(torch.bfloat16)}
        )
        exchange.upto(2 * n)
        exchange.wait()
        assert torch.equal(a, y) and torch.equal(b, x), n
    assert not _Blocks._broken  # the table kernel built and ran (1 << 20 words take it)


def test_exchanges_wait_for_the_current_streams_work() -> None:
    _, slices = on_cpu._staged([1 << 20], "cuda")
    (name, end, view) = slices[0]
    engine = {name: torch.zeros_like(view)}
    exchange = Exchange.of(slices, engine)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # tens of ms of GPU time before the fill
        view.fill_(3.0)
        exchange.upto(end)  # queued behind the fill
    exchange.wait()
    assert bool((engine[name] == 3.0).all())


def test_a_running_check_hands_on_and_a_flipped_byte_is_taken_back() -> None:
    plan, staging, region, _ = checks._pulled(MemType.VRAM, "cuda")
    slices = _slices(plan, staging)
    new = {name: view.clone() for name, _, view in slices}
    engine = {
        name: torch.randn(view.shape, device="cuda").to(view.dtype) for name, _, view in slices
    }
    old = {name: t.clone() for name, t in engine.items()}

    exchange = Exchange.of(slices, engine)
    check = RunningCheck(plan, region, part_bytes=1, after=exchange.upto)
    check.advance(plan.nbytes)
    assert check.finish() == len(checks.SHAPES)
    exchange.wait()
    assert all(_same(engine[n], new[n]) for n in engine)
    exchange.undo()
    assert all(_same(engine[n], old[n]) for n in engine)

    victim = max(range(len(plan.reads)), key=lambda i: checks._end(plan, i))
    staging[int(plan.reads[victim].dest_offsets[0]) + 1] ^= 0x10
    exchange = Exchange.of(slices, engine)
    check = RunningCheck(plan, region, part_bytes=1, after=exchange.upto)
    check.advance(plan.nbytes // 2)
    assert exchange.exchanged > 0  # some were exchanged before the end
    with pytest.raises(ChecksumMismatch, match=f"{plan.reads[victim].parameter} shard 0"):
        check.finish()
    exchange.undo()
    assert all(_same(engine[n], old[n]) for n in engine)


def test_what_exchanging_a_1b_layout_costs() -> None:
    plan, staging, _, _ = checks._pulled(MemType.VRAM, "cuda", _layout_1b(), wsum.host_wsum64)
    slices = _slices(plan, staging)
    engine = {name: torch.empty_like(view) for name, _, view in slices}
    before = [view.clone() for _, _, view in slices]
    copies = [torch.empty_like(view) for _, _, view in slices]
    times: dict[str, list[float]] = {"exchange": [], "copy": []}
    for _ in range(5):
        exchange = Exchange.of(slices, engine)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        with torch.cuda.stream(exchange.stream):
            start.record()
        exchange.upto(plan.nbytes)
        with torch.cuda.stream(exchange.stream):
            stop.record()
        exchange.wait()
        times["exchange"].append(start.elapsed_time(stop))
        start.record()
        for target, (name, _, _) in zip(copies, slices, strict=True):
            target.copy_(engine[name])
        stop.record()
        torch.cuda.synchronize()
        times["copy"].append(start.elapsed_time(stop))
    best = {k: min(v) for k, v in times.items()}
    print(
        f"\n{plan.nbytes / 1e9:.2f} GB in {len(slices)} tensors: exchange "
        f"{best['exchange']:.3f} ms, device-local copy {best['copy']:.3f} ms (best of 5)"
    )
    # Five exchanges: the engine's tensors hold what staging held, as the copies do.
    assert all(_same(engine[n], b) for (n, _, _), b in zip(slices, before, strict=True))
