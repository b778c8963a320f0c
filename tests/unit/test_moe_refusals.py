"""What the service refuses for a mixture-of-experts model before any rank starts: nothing
half-works. (What a vLLM receiver refuses: tests/inference/test_expert_slices.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_hf.spec import ModelFamily
from megatron_hf.tiny import write_tiny_checkpoint
from trainer_svc.__main__ import _check_layout
from trainer_svc.config import Device, ParallelLayout, TrainerConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("moe"), ModelFamily.QWEN3_MOE)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            TrainerConfig(
                layout=ParallelLayout(tensor_parallel=2, data_parallel=3, expert_parallel=3)
            ),
            "8 experts do not split over expert parallel 3",
        ),
        (
            TrainerConfig(layout=ParallelLayout(tensor_parallel=2)),
            "mixture-of-experts layers at tensor parallel 2 need expert parallel > 1 or expert "
            "tensor parallel 2",
        ),
        (
            TrainerConfig(
                layout=ParallelLayout(data_parallel=2, expert_tensor_parallel=2),
                device=Device.CPU,
            ),
            "expert tensor parallel 2 needs GPU ranks",
        ),
    ],
)
def test_the_service_refuses_before_any_rank_starts(model_dir, config, message, capsys):
    with pytest.raises(SystemExit) as exited:
        _check_layout(config, model_dir)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_expert_grids_must_fit_a_stage():
    with pytest.raises(ValueError, match=r"expert parallel 4 x expert tensor parallel 1 = 4"):
        ParallelLayout(data_parallel=2, expert_parallel=4)
