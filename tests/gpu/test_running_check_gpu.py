"""`running_check.RunningCheck` on a GPU: the parts' sums run on a stream of their own and are
waited for in `finish`; a flipped byte fails the check, and bytes changed after their part was
summed are caught after a restart. Run on a lent GPU machine:

    python -m pytest -m gpu tests/gpu -s
"""

from __future__ import annotations

import pytest
import torch

from refit_sidecar.manifest import MemType
from refit_sidecar.running_check import RunningCheck
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
