"""The model the trainer builds (`model_factory.build_model`) has transformers' logits on tiny
llama3, yarn and linear RoPE checkpoints, on sequences three times longer than the original
context, with SDPA and with megatron's local attention (YaRN's attention factor goes in through
the softmax scale); float32 on the CPU. The same model built unscaled misses transformers' by
far more than the tolerance, so the comparison does see the scaling."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from megatron_hf.rope import RopeScaling
from megatron_hf.spec import ModelFamily, ModelSpec, padded_vocab_size
from megatron_hf.tiny import write_tiny_checkpoint
from tests.support.isolation import in_child_process
from tests.support.megatron_world import one_rank_model_parallel
from tests.support.parity import TOLERANCE
from trainer_svc.config import Attention, ParallelLayout, ParamsDType
from trainer_svc.runtime import cpu_compat
from trainer_svc.runtime.model_factory import build_model
from trainer_svc.runtime.topology import Topology
from trainer_svc.runtime.weights import load_hf_weights

ORIGINAL = 32
"""The tiny models' pretraining context; the sequences are three times as long."""
CASES: dict[str, tuple[ModelFamily, dict[str, Any], tuple[Attention, ...]]] = {
    "llama3": (
        ModelFamily.LLAMA,
        {
            "max_position_embeddings": 4 * ORIGINAL,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": ORIGINAL,
            },
        },
        (Attention.SDPA,),
    ),
    "yarn": (
        ModelFamily.QWEN3,
        {
            "head_dim": 24,
            "max_position_embeddings": 4 * ORIGINAL,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": ORIGINAL,
            },
        },
        (Attention.SDPA, Attention.LOCAL),
    ),
    "linear": (
        ModelFamily.QWEN2,
        {
            "max_position_embeddings": 4 * ORIGINAL,
            "rope_scaling": {"type": "linear", "factor": 2.0},
        },
        (Attention.SDPA,),
    ),
}


def _trainer_logprobs(
    model_dir: Path, spec: ModelSpec, tokens: torch.Tensor, attention: Attention
) -> torch.Tensor:
    topology = Topology.from_parallel_state(ParallelLayout())
    padded = padded_vocab_size(spec.vocab_size, 1)
    with cpu_compat.active(), torch.no_grad():
        model, _ = build_model(
            spec,
            topology,
            padded_vocab=padded,
            max_sequence_length=spec.max_position_embeddings,
            params_dtype=ParamsDType.FLOAT32,
            on_gpu=False,
            attention=attention,
        )
        load_hf_weights(model, model_dir, spec, topology, padded)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        logits = model(tokens, positions, None)[..., : spec.vocab_size]
    return torch.log_softmax(logits, dim=-1)


def _hf_logprobs(model_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(tokens).logits, dim=-1)


@in_child_process
def test_forward_equals_transformers_past_the_original_context(tmp_path: Path) -> None:
    one_rank_model_parallel(cuda=False)
    tokens = torch.randint(4, 101, (2, 3 * ORIGINAL), generator=torch.Generator().manual_seed(5))
    for name, (family, options, attentions) in CASES.items():
        model_dir = write_tiny_checkpoint(tmp_path / name, family, seed=11, **options)
        spec = ModelSpec.from_pretrained_dir(model_dir)
        assert spec.rope_scaling != RopeScaling()
        want = _hf_logprobs(model_dir, tokens)
        for attention in attentions:
            got = _trainer_logprobs(model_dir, spec, tokens, attention)
            gap = (got - want).abs().max().item()
            assert gap <= TOLERANCE, f"{name} with {attention.value}: {gap}"
        unscaled = dataclasses.replace(spec, rope_scaling=RopeScaling())
        dropped = _trainer_logprobs(model_dir, unscaled, tokens, attentions[0])
        gap = (dropped - want).abs().max().item()
        assert gap > 10 * TOLERANCE, f"{name} unscaled is only {gap} from transformers"
