"""`in_place.InPlace` on a GPU: the CPU test's adoption, restore and release, with the backup
copied on a stream of its own behind the install's work. Run on a GPU machine:

    python -m pytest -m gpu tests/gpu -s
"""

from __future__ import annotations

import pytest
import torch

from inference_ext.staged_tensors import InPlace, candidates
from tests.inference import test_in_place as on_cpu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_adoption_restore_and_release_as_on_the_cpu() -> None:
    on_cpu.test_adopted_tensors_live_in_staging_and_a_failed_pull_is_restored("cuda")


def test_many_tensors_are_cast_in_as_on_the_cpu() -> None:
    on_cpu.test_many_tensors_are_cast_in_per_pair_of_dtypes_bit_for_bit("cuda")


def test_cast_tensors_share_one_arena_as_on_the_cpu() -> None:
    on_cpu.test_cast_tensors_staged_together_live_in_one_arena_cast_in_one_copy("cuda")


def test_the_backup_waits_for_the_install_queued_before_it() -> None:
    staging, views = on_cpu._layout("cuda")
    engine = {name: view.clone() for name, view in views.items()}
    in_place = InPlace()
    in_place.adopt(("layout",), candidates(views, engine)[0], staging, held=None)
    assert in_place.prepare(("layout",))
    torch.cuda._sleep(50_000_000)  # the install's last copy, late on the current stream
    engine["b"].fill_(5.0)
    in_place.back_up()  # behind it
    assert in_place.prepare(("layout",))  # waits for the backup
    staging.zero_()
    in_place.restore()
    assert bool((engine["b"] == 5.0).all())
