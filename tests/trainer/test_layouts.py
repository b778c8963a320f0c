"""TP=1, TP=2 and PP=2 started from the same HF checkpoint agree: Forward logprobs and the
weights after identical steps, one per RL loss and correction (PPO with KL, GSPO, CISPO with
the constant normalization, dual clip with an entropy bonus, TIS against a sampler); the TP=2
world also equals HF transformers (test_hf_parity's Qwen2 case). A layout the model cannot be
split into is refused before any rank starts."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from megatron_hf.spec import ModelFamily
from megatron_hf.tiny import write_tiny_checkpoint
from tests.support.batches import make_batch
from tests.support.parity import assert_equals_transformers, parity_forward
from tests.support.trainer import (
    TEST_ENV,
    TrainerProcess,
    max_relative_difference,
    start_trainers,
    stop_trainers,
)
from trainer_svc.domain import (
    Correction,
    ForwardResult,
    LossConfig,
    LossKind,
    Normalization,
    OptimizerOverrides,
)

FAMILY = ModelFamily.QWEN2
"""QKV biases: the fused tensor that TP splits by query group has a bias to split too."""
LOSS = LossConfig(kind=LossKind.PPO, normalization=Normalization.SEQUENCE, kl_coef=0.1)
# See test_split_step: a larger Adam eps makes the first update a smooth function of the grads.
OPTIMIZER = OptimizerOverrides(learning_rate=1e-3, adam_eps=1e-4)
LAYOUTS = {"tp1": [], "tp2": ["--tp", "2"], "pp2": ["--pp", "2"]}
STEPS = {
    "ppo-kl": LOSS,
    "gspo": LossConfig(
        kind=LossKind.GSPO, normalization=Normalization.SEQUENCE, clip_low=0.05, clip_high=0.08
    ),
    "cispo-constant": LossConfig(
        kind=LossKind.CISPO, normalization=Normalization.CONSTANT, normalization_length=32
    ),
    "ppo-dual-clip-entropy": LossConfig(kind=LossKind.PPO, dual_clip=2.0, entropy_coef=0.01),
    "ppo-tis": LossConfig(kind=LossKind.PPO, correction=Correction.TIS),
}
"""Run one after another in every world, each step from the weights the previous one left."""


@dataclass(frozen=True)
class Run:
    logprobs: np.ndarray
    weights: dict[str, dict[str, np.ndarray]]
    """After each of STEPS, by name."""


@dataclass(frozen=True)
class Layouts:
    model_dir: Path
    runs: dict[str, Run]
    parity: ForwardResult
    """The TP=2 world's `parity_forward`, taken before its step."""


def _run(process: TrainerProcess) -> Run:
    batch = make_batch(seed=11, lengths=[14, 9, 23, 5], loss=LOSS)
    logprobs = process.client.forward(batch).logprobs
    assert logprobs is not None
    weights = {}
    for name, loss in STEPS.items():
        process.client.begin_step(name, loss, OPTIMIZER)
        process.client.train_microbatch(
            name, "r", make_batch(seed=11, lengths=[14, 9, 23, 5], loss=loss)
        )
        process.client.finish_step(name)
        weights[name] = process.export(f"after-{name}")
    return Run(logprobs, weights)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Layouts]:
    """Both worlds start at once; every Forward and step runs here, in one order, so that each
    check sees the weights it expects whatever order the tests run in."""
    root = tmp_path_factory.mktemp("layouts")
    model_dir = write_tiny_checkpoint(root / "model", FAMILY, num_layers=2, seed=5)
    processes = start_trainers(
        {name: (root / name, ["--model", str(model_dir), *args]) for name, args in LAYOUTS.items()}
    )
    try:
        parity = parity_forward(processes["tp2"])
        runs = {name: _run(process) for name, process in processes.items()}
        yield Layouts(model_dir, runs, parity)
    finally:
        assert stop_trainers(processes.values()) == [0] * len(processes)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_a_split_layout_matches_one_rank_for_every_loss(layouts, layout):
    one, split = layouts.runs["tp1"], layouts.runs[layout]
    assert np.abs(one.logprobs - split.logprobs).max() <= 1e-5
    for name in STEPS:
        gap = max_relative_difference(split.weights[name], one.weights[name])
        assert gap <= 1e-5, f"{layout} after {name}: {gap:.2e}"


def test_tensor_parallel_two_equals_transformers(layouts):
    assert_equals_transformers(layouts.parity, layouts.model_dir)


REFUSALS: dict[str, tuple[dict[str, Any], list[str], str]] = {
    "mqa-tp2": (
        {"num_key_value_heads": 1},
        ["--tp", "2"],
        "1 key/value heads (query groups) do not split over tensor parallel 2",
    ),
    "layers-pp2": (
        {"num_layers": 3},
        ["--pp", "2"],
        "num_layers (3) must be divisible by pipeline_parallel (2)",
    ),
}


def _start_refused(model_dir: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
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
    return subprocess.run(
        [*command, *args],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, **TEST_ENV},
        timeout=300,
    )


@pytest.fixture(scope="module")
def refusals(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every case's service, started at once: each runs on one core until it exits."""
    root = tmp_path_factory.mktemp("refusals")
    models = {
        name: write_tiny_checkpoint(root / name, ModelFamily.LLAMA, **{"num_layers": 2, **shape})
        for name, (shape, _, _) in REFUSALS.items()
    }
    with ThreadPoolExecutor(max_workers=len(REFUSALS)) as pool:
        futures = {
            name: pool.submit(_start_refused, models[name], args)
            for name, (_, args, _) in REFUSALS.items()
        }
    return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_an_unsplittable_layout_is_refused_before_any_rank_starts(refusals, case):
    """Megatron builds one KV group over two TP ranks and fails only on the first step; the
    service refuses such a layout at start, naming the numbers, and starts no rank (a rank
    logs under "[rank N]": nothing did)."""
    result, message = refusals[case], REFUSALS[case][2]
    assert result.returncode == 2
    assert message in result.stderr
    assert "[rank" not in result.stderr
