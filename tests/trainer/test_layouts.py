"""TP=1 and TP=2 started from the same HF checkpoint agree: Forward logprobs and the weights
after one identical step."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hf.spec import ModelFamily
from megatron_hf.tiny import write_tiny_checkpoint
from tests.support.batches import make_batch
from tests.support.trainer import TrainerProcess, max_relative_difference
from trainer_svc.domain import LossConfig, LossKind, Normalization, OptimizerOverrides

LOSS = LossConfig(kind=LossKind.PPO, normalization=Normalization.SEQUENCE, kl_coef=0.1)
# See test_split_step: a larger Adam eps makes the first update a smooth function of the grads.
OPTIMIZER = OptimizerOverrides(learning_rate=1e-3, adam_eps=1e-4)


def _run(workdir, model_dir, args) -> tuple[np.ndarray, dict]:
    process = TrainerProcess(workdir, ["--model", str(model_dir), *args])
    try:
        batch = make_batch(seed=11, lengths=[14, 9, 23, 5], loss=LOSS)
        logprobs = process.client.forward(batch).logprobs
        process.client.begin_step("s", LOSS, OPTIMIZER)
        process.client.train_microbatch("s", "r", batch)
        process.client.finish_step("s")
        return logprobs, process.export("after-step")
    finally:
        assert process.stop() == 0


@pytest.mark.parametrize("family", [ModelFamily.QWEN2])
def test_tensor_parallel_two_matches_one(tmp_path, family):
    model_dir = write_tiny_checkpoint(tmp_path / "model", family, num_layers=2, seed=5)
    logprobs_1, weights_1 = _run(tmp_path / "tp1", model_dir, [])
    logprobs_2, weights_2 = _run(tmp_path / "tp2", model_dir, ["--tp", "2"])
    assert np.abs(logprobs_1 - logprobs_2).max() <= 1e-5
    assert max_relative_difference(weights_2, weights_1) <= 1e-5
