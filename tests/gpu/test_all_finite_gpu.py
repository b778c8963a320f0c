"""`all_finite` on a GPU: it finds a NaN in a gradient-sized buffer and allocates next to
nothing beside it (a float64 sum, used before, cast the whole buffer first: 22.5 GiB more for a
3B model's gradients). Run on a lent GPU machine:

    python -m pytest -m gpu tests/gpu -s
"""

from __future__ import annotations

import pytest
import torch

from trainer_svc.runtime.finite import all_finite

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_all_finite_needs_no_buffer_sized_temporary() -> None:
    grads = [torch.zeros(1 << 28, dtype=torch.float32, device="cuda")]  # 1 GiB
    grads.append(torch.zeros(1 << 20, dtype=torch.bfloat16, device="cuda"))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    assert all_finite(grads)
    grads[0][123_456_789] = float("nan")
    assert not all_finite(grads)
    extra = torch.cuda.max_memory_allocated() - before
    print(f"\nall_finite over 1 GiB of gradients: {extra} bytes allocated beside them")
    assert extra < 1 << 20, extra
