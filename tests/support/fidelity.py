"""Ground truth for refit fidelity: train a step through the service, and compare an engine's
prompt logprobs with the trainer's own Forward on the same tokens; the tensors each worker
installed against ExportHF's (for experts: vLLM's fused w13/w2, built here from ExportHF's
per-expert tensors the way vLLM's loader narrows them)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from inference_ext.expert_slices import (
    ExpertTarget,
    FusedExpertTensor,
    parse_target,
    receiver_names,
)
from inference_ext.slices import ReceiverLayout
from megatron_hf.experts import hf_expert_names
from megatron_hf.fused import stack_experts
from megatron_hf.spec import ModelSpec
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


def fused_experts_of(
    hf: Mapping[str, Any], spec: ModelSpec, layout: ReceiverLayout, target: ExpertTarget
) -> torch.Tensor:
    """vLLM's fused `target` on the worker at `layout`, from per-expert HF tensors (numpy or
    torch): with expert parallelism the worker's contiguous share of the experts whole, else
    every expert's share of the width (gate rows, then up rows; down columns)."""
    assert spec.moe is not None
    names = hf_expert_names(spec.family)
    tp, rank = layout.tp_size, layout.tp_rank
    if layout.expert_parallel and tp > 1:
        per = spec.moe.num_experts // tp
        experts, cols = range(rank * per, (rank + 1) * per), slice(None)
    else:
        per = spec.moe.ffn_hidden_size // tp
        experts, cols = range(spec.moe.num_experts), slice(rank * per, (rank + 1) * per)
    prefix = f"model.layers.{target.layer}.{names.experts}"

    def weight(e: int, projection: str) -> torch.Tensor:
        return torch.as_tensor(hf[f"{prefix}.{e}.{projection}.weight"])

    w13, w2 = stack_experts(weight, names, experts, cols)
    return w13 if target.tensor is FusedExpertTensor.W13 else w2


def check_installed_slices(
    per_worker: list[dict],
    exported: dict,
    tp: int,
    *,
    spec: ModelSpec | None = None,
    expert_parallel: bool = False,
) -> None:
    """Each worker installed exactly its slice of every exported tensor, bit for bit, and the
    workers' slices together cover every tensor. For a mixture of experts (`spec`), each
    worker's fused experts instead equal `fused_experts_of` ExportHF's."""
    assert len(per_worker) == tp
    names = set(exported)
    if spec is not None and spec.moe is not None:
        experts = f".{hf_expert_names(spec.family).experts}."
        names = {n for n in names if experts not in n}
        targets = {n for n in receiver_names(spec, sorted(exported)) if parse_target(n)}
        for rank, worker in enumerate(per_worker):
            layout = ReceiverLayout(rank, tp, expert_parallel)
            assert set(worker) == names | targets
            for name in targets:
                target = parse_target(name)
                assert target is not None
                expected = fused_experts_of(exported, spec, layout, target)
                assert torch.equal(worker[name][1], expected), (name, layout)
        exported = {n: exported[n] for n in names}
        per_worker = [{n: s for n, s in w.items() if n in names} for w in per_worker]
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
