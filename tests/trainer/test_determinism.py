"""`--deterministic`: the process runs deterministic algorithms only, megatron looks the
embedding up by indexing, and the model's forward and backward run under those settings without
an op refusing. The CPU repeats bit for bit with or without the flag; that a GPU does with it,
and does not without, is measured (`scripts/gpu_refit_suite.sh determinism`, BENCHMARKS.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.support.isolation import in_child_process
from tests.support.megatron_world import cpu_model, lm_loss, one_rank_model_parallel
from trainer_svc.builtin_model import write_builtin_model
from trainer_svc.cli import parse_config
from trainer_svc.runtime import determinism


@in_child_process
def test_a_deterministic_model_runs_deterministic_algorithms_and_repeats(model_dir: Path) -> None:
    from trainer_svc.runtime import cpu_compat

    determinism.apply(True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == determinism.CUBLAS_WORKSPACE
    one_rank_model_parallel(cuda=False)
    with cpu_compat.active():
        model, config, tokens = cpu_model(model_dir, deterministic=True)
        assert config.deterministic_mode
        assert model.embedding.word_embeddings.deterministic_mode  # indexing, no atomics
        runs = []
        for _ in range(2):
            model.zero_grad()
            lm_loss(model, tokens).backward()
            runs.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    determinism.apply(False)
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_builtin_model(tmp_path / "model", seed=3)


def test_the_flag_is_off_by_default() -> None:
    assert not parse_config(["--insecure"])[0].model.deterministic
    assert parse_config(["--insecure", "--deterministic"])[0].model.deterministic
