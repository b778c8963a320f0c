"""The model the trainer builds, run on one laid-out batch (`runtime/packing.py`) in the test
process: what the sequence-layout tests on the CPU and the GPU compare."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_hf.spec import ModelSpec, padded_vocab_size
from trainer_svc.config import Attention, ParallelLayout, ParamsDType
from trainer_svc.domain import LossConfig
from trainer_svc.runtime.losses import loss_sums
from trainer_svc.runtime.model_factory import build_model
from trainer_svc.runtime.packing import PackedBatch
from trainer_svc.runtime.topology import Topology
from trainer_svc.runtime.weights import load_hf_weights


def built_model(
    model_dir: Path,
    attention: Attention,
    *,
    params_dtype: ParamsDType = ParamsDType.FLOAT32,
    on_gpu: bool = False,
) -> torch.nn.Module:
    """A one-rank model of the checkpoint in `model_dir` (call under `cpu_compat.active()` on
    the CPU)."""
    spec = ModelSpec.from_pretrained_dir(model_dir)
    topology = Topology.from_parallel_state(ParallelLayout())
    padded = padded_vocab_size(spec.vocab_size, 1)
    model, _ = build_model(
        spec,
        topology,
        padded_vocab=padded,
        max_sequence_length=spec.max_position_embeddings,
        params_dtype=params_dtype,
        on_gpu=on_gpu,
        attention=attention,
    )
    load_hf_weights(model, model_dir, spec, topology, padded)
    return model


def run_layout(
    model: torch.nn.Module, batch: PackedBatch, loss: LossConfig
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Per-position logprobs of the targets (float32), and every parameter's gradient of the
    loss (float32)."""
    model.zero_grad(set_to_none=True)
    logits = model(batch.inputs, batch.positions, None, packed_seq_params=batch.documents)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = logprobs.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    loss_sums(picked, batch.token_inputs, loss)["loss"].backward()
    return picked.detach(), [p.grad.float().clone() for p in model.parameters()]


def predicted(batch: PackedBatch) -> torch.Tensor:
    """The padded layout's positions that predict a token (the rest is padding)."""
    counts = torch.as_tensor(batch.target_counts, device=batch.positions.device)
    return batch.positions < counts[:, None]
