"""A fan-out receiver's progress words in device memory (`torch_arena.TorchWords`): writing and
reading one waits for nothing else the process queued on the GPU. A child polls its parent's
word while its own data copies are in flight, and a receiver inside a vLLM worker writes its
word while the engine's kernels run; a copy on the legacy default stream would wait for them.
Run on a lent GPU machine:

    python -m pytest -m gpu tests/gpu -s
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from refit_sidecar.memory.tensor_arena import TorchWords
from refit_sidecar.pull.progress import PROGRESS_BYTES, CopyProgress, OwnProgress, ProgressWord

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _busy_default_stream(seconds: float) -> None:
    """Queue about `seconds` of spinning on the current (legacy default) stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    cycles_per_ms = 1_000_000 / max(start.elapsed_time(end), 1e-3)
    torch.cuda._sleep(int(cycles_per_ms * 1e3 * seconds))


def test_a_word_is_written_and_read_without_waiting_for_queued_gpu_work() -> None:
    words = TorchWords(64, device=torch.device("cuda"))
    own = OwnProgress("receiver", words)
    _busy_default_stream(2.0)
    began = time.perf_counter()
    own.start(7)
    own.filled(4096)
    word = ProgressWord.decode(words.read(0, PROGRESS_BYTES))
    took = time.perf_counter() - began
    busy = torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert word == ProgressWord(7, 4096, CopyProgress.FILLING)
    assert not busy, "the queued work ended before the words were done: no test"
    assert took < 0.5, f"the words took {took:.3f} s behind 2 s of queued work"
    # What NIXL reads is the device tensor itself.
    device_bytes = words.tensor[:PROGRESS_BYTES].cpu().numpy()
    assert ProgressWord.decode(device_bytes) == word
    assert np.array_equal(words.read(0, PROGRESS_BYTES), device_bytes)


def test_fills_are_queued_without_waiting_and_land_in_order_behind_every_store() -> None:
    """`OwnProgress.filled` queues its word (the copy's fill grows many times a pull): more
    fills than the pinned ring holds reuse each slot only after its copy ran, and a later
    store that waits (`start`, `finish`) lands after every fill queued before it."""
    words = TorchWords(64, device=torch.device("cuda"))
    own = OwnProgress("receiver", words)
    own.start(3)
    for step in range(1, 3 * TorchWords._RING + 1):
        own.filled(step * 4096)
    own.finish(CopyProgress.COMPLETE)
    assert ProgressWord.decode(words.read(0, PROGRESS_BYTES)) == ProgressWord(
        3, 3 * TorchWords._RING * 4096, CopyProgress.COMPLETE
    )
    own.start(4)  # a new version: its fill starts at 0, whatever was queued before
    own.filled(512)
    assert ProgressWord.decode(words.read(0, PROGRESS_BYTES)) == ProgressWord(
        4, 512, CopyProgress.FILLING
    )
