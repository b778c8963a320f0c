"""Deterministic training data for tests: ragged sequences with prompts, masks and RL inputs."""

from __future__ import annotations

import itertools

import numpy as np

from trainer_svc.domain import LossConfig, SequenceBatch


def make_batch(
    seed: int, lengths: list[int], loss: LossConfig, vocab_size: int = 100, prompt: int = 3
) -> SequenceBatch:
    rng = np.random.default_rng(seed)
    tokens = [rng.integers(0, vocab_size, size=n).tolist() for n in lengths]
    mask = [[i >= min(prompt, n - 1) for i in range(n)] for n in lengths]
    kwargs: dict = {}
    if loss.needs_policy_inputs:
        kwargs["advantages"] = [rng.normal(size=n).astype(np.float32) for n in lengths]
        kwargs["behaviour_logprobs"] = [
            (np.log(1 / vocab_size) + rng.normal(scale=0.3, size=n)).clip(max=0.0) for n in lengths
        ]
    if loss.corrects_sampler:
        kwargs["sampler_logprobs"] = [
            (np.log(1 / vocab_size) + rng.normal(scale=0.5, size=n)).clip(max=0.0) for n in lengths
        ]
    if loss.needs_reference:
        kwargs["reference_logprobs"] = [
            (np.log(1 / vocab_size) + rng.normal(scale=0.3, size=n)).clip(max=0.0) for n in lengths
        ]
    return SequenceBatch.from_lists(tokens, loss_mask=mask, **kwargs)


def split(batch: SequenceBatch, sizes: list[int]) -> list[SequenceBatch]:
    """Consecutive sub-batches with the given numbers of sequences."""
    assert sum(sizes) == batch.num_sequences
    bounds = np.cumsum([0, *sizes])
    return [batch.select(np.arange(a, b)) for a, b in itertools.pairwise(bounds)]
