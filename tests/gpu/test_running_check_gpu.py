"""`running_check.RunningCheck` on a GPU: the parts' sums run on a stream of their own and are
waited for in `finish`; a flipped byte fails the check, bytes changed after their part was
summed are caught after a restart, and checksums given at the end (a pull that started before
its version was readable) are the ones compared. Over a layout shaped like the 1B preset's it
prints what a part's start and the check's end cost on the calling thread, alone and beside a
thread that polls as a pull's loop does. Run on a GPU machine:

    python -m pytest -m gpu tests/gpu -s
"""

from __future__ import annotations

import statistics
import threading
import time

import pytest
import torch

from refit_sidecar.core.manifest import MemType
from refit_sidecar.integrity import wsum
from refit_sidecar.pull.running_check import RunningCheck
from tests.refit import test_running_check as on_cpu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_a_check_in_device_memory_sums_its_parts_and_finds_a_flipped_byte() -> None:
    plan, _, region, _ = on_cpu._pulled(MemType.VRAM, "cuda")
    check = RunningCheck(plan, region, part_bytes=1)
    check.advance(plan.nbytes)
    assert check.started == len(on_cpu.SHAPES)
    assert check.finish() == len(on_cpu.SHAPES)
    on_cpu.test_a_flipped_byte_fails_the_check_naming_its_shard("cuda")
    on_cpu.test_bytes_read_again_after_their_part_started_are_checked_after_a_restart("cuda")
    on_cpu.test_checksums_given_at_the_end_are_the_ones_compared("cuda")


def _layout_1b() -> list[tuple[int, ...]]:
    """111 tensors shaped like the refit benchmarks' 1B preset (TP=1), in Megatron's order,
    but for q/k/v of 3,072 rows (1.89 GB): the layout of the refit benchmarks' 1B preset."""
    hidden, ffn, layers, vocab = 2048, 5632, 18, 32000
    shapes: list[tuple[int, ...]] = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden,), (3072, hidden), (hidden, hidden), (hidden,), (2 * ffn, hidden)]
        shapes += [(hidden, ffn)]
    return [*shapes, (hidden,), (vocab, hidden)]


def test_what_a_part_costs_the_thread_that_starts_it() -> None:
    plan, _, region, _ = on_cpu._pulled(MemType.VRAM, "cuda", _layout_1b(), wsum.host_wsum64)
    for part_bytes in (256 << 20, 512 << 20):
        for busy in (False, True):
            stop = threading.Event()

            def poll(stop: threading.Event = stop) -> None:
                count = 0
                while not stop.is_set():
                    for _ in range(200):
                        count += 1
                    time.sleep(2e-5)

            poller = threading.Thread(target=poll, daemon=True)
            if busy:
                poller.start()
            starts, ends = [], []
            for rep in range(8):
                check = RunningCheck(plan, region, part_bytes=part_bytes)
                parts = check._cut()
                for part in parts[:-1]:
                    begin = time.perf_counter()
                    check.advance(part.end)
                    if rep:  # the first pull lays the parts out
                        starts.append(time.perf_counter() - begin)
                begin = time.perf_counter()
                assert check.finish() == len(plan.reads)
                if rep:
                    ends.append(time.perf_counter() - begin)
            stop.set()
            print(
                f"parts of {part_bytes >> 20} MiB ({len(parts)}), a polling thread beside: "
                f"{busy}; a part's start {1e3 * statistics.median(starts):.3f} ms (median), "
                f"the check's end {1e3 * statistics.median(ends):.3f} ms"
            )
