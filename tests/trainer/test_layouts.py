"""TP=1 and TP=2 started from the same HF checkpoint agree: Forward logprobs and the weights
after one identical step."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from megatron_hf.spec import ModelFamily
from megatron_hf.tiny import write_tiny_checkpoint
from tests.support.batches import make_batch
from tests.support.trainer import TEST_ENV, TrainerProcess, max_relative_difference
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


@pytest.mark.parametrize(
    ("shape", "args", "message"),
    [
        (
            {"num_key_value_heads": 1},
            ["--tp", "2"],
            "1 key/value heads (query groups) do not split over tensor parallel 2",
        ),
        (
            {"num_layers": 3},
            ["--pp", "2"],
            "num_layers (3) must be divisible by pipeline_parallel (2)",
        ),
    ],
    ids=["mqa-tp2", "layers-pp2"],
)
def test_an_unsplittable_layout_is_refused_before_any_rank_starts(tmp_path, shape, args, message):
    """Megatron builds one KV group over two TP ranks and fails only on the first step; the
    service refuses such a layout at start, naming the numbers, and starts no rank."""
    model_dir = write_tiny_checkpoint(
        tmp_path / "model", ModelFamily.LLAMA, **{"num_layers": 2, **shape}
    )
    command = [
        sys.executable,
        "-m",
        "trainer_svc",
        "--port",
        "0",
        "--insecure",
        "--model",
        str(model_dir),
    ]
    started = time.monotonic()
    result = subprocess.run(
        [*command, *args],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, **TEST_ENV},
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert "[rank" not in result.stderr
    assert time.monotonic() - started < 30
