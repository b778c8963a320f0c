"""Ground truth for refit fidelity: train a step through the service, and compare an engine's
prompt logprobs with the trainer's own Forward on the same tokens."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from tests.support.batches import make_batch
from tests.support.trainer import TrainerProcess
from trainer_svc.domain import LossConfig, OptimizerOverrides, SequenceBatch

PROMPTS = [[5, 17, 33, 2, 9, 40, 41, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [60, 61, 3]]
FIDELITY = 1e-4
"""Largest |vLLM logprob - trainer logprob| accepted (fp32 on both sides)."""


def train_step(trainer: TrainerProcess, step_id: str, seed: int, lr: float = 2e-2) -> int:
    """One cross-entropy step on a seeded batch; returns the new weights version."""
    loss = LossConfig()
    trainer.client.begin_step(step_id, loss, OptimizerOverrides(learning_rate=lr))
    batch = make_batch(seed=seed, lengths=[12, 9, 15], loss=loss)
    trainer.client.train_microbatch(step_id, "r", batch)
    return trainer.client.finish_step(step_id).weights_version


def trainer_logprobs(
    trainer: TrainerProcess, prompts: Sequence[Sequence[int]] = PROMPTS
) -> list[np.ndarray]:
    """The trainer's logprob of token i given tokens < i, for i >= 1, of each prompt."""
    batch = SequenceBatch.from_lists(
        [list(p) for p in prompts], loss_mask=[[True] * len(p) for p in prompts]
    )
    logprobs = trainer.client.forward(batch).logprobs
    assert logprobs is not None
    bounds = np.cumsum([0, *map(len, prompts)])
    return [logprobs[start + 1 : stop] for start, stop in itertools.pairwise(bounds)]


def gap(a: Sequence, b: Sequence) -> float:
    """Largest absolute difference between two lists of per-prompt logprobs."""
    return max(
        float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(a, b, strict=True)
    )


def check_installed_slices(per_worker: list[dict], exported: dict, tp: int) -> None:
    """Each worker installed exactly its slice of every exported tensor, bit for bit, and the
    workers' slices together cover every tensor."""
    assert len(per_worker) == tp
    names = set(exported)
    for worker in per_worker:
        assert set(worker) == names
        for name, (box, tensor) in worker.items():
            index = tuple(slice(a, b) for a, b in box.ranges)
            expected = torch.from_numpy(exported[name])[index]
            assert torch.equal(tensor, expected), name
    for name, full in exported.items():
        covered = torch.zeros(full.shape, dtype=torch.bool)
        for worker in per_worker:
            covered[tuple(slice(a, b) for a, b in worker[name][0].ranges)] = True
        assert bool(covered.all()), f"{name} is not fully installed across the workers"
