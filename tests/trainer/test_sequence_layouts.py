"""Packed rows (`--sequence-layout packed`, several sequences back to back in one row) compute
what padded rows compute: the model the trainer builds gives the same per-token logprobs and the
same gradients for both layouts of one batch, within 1e-5 in float32 on the CPU, for grouped
-query attention and for a YaRN checkpoint (scaled softmax, scaled RoPE). A control shows the
comparison sees the document bounds: the same row without them (attention across sequences)
misses by far more. (Positions that run on through the row instead of restarting would pass:
RoPE scores depend on relative positions only, so restarting is a matter of float precision
at large angles.) Which layout the trainer picks for each `--sequence-layout` and attention is
checked too, and that the built model's norms are the fused-kernel kind.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from megatron_hf.spec import ModelFamily
from megatron_hf.tiny import write_tiny_checkpoint
from tests.support.batches import make_batch
from tests.support.isolation import in_child_process
from tests.support.megatron_world import one_rank_model_parallel
from tests.support.sequence_layouts import built_model, predicted, run_layout
from trainer_svc.config import Attention, ModelConfig, PackedAttention, SequenceLayout
from trainer_svc.domain import LossConfig, LossKind, Normalization
from trainer_svc.runtime import cpu_compat, documents, norms, ragged_attention
from trainer_svc.runtime.packing import pack

CPU = torch.device("cpu")
LENGTHS = [9, 23, 2, 1, 16, 31, 5]
LOSS = LossConfig(kind=LossKind.PPO, normalization=Normalization.SEQUENCE, kl_coef=0.1)
CASES: dict[str, tuple[ModelFamily, dict[str, Any]]] = {
    "llama-gqa": (ModelFamily.LLAMA, {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "qwen3-yarn": (
        ModelFamily.QWEN3,
        {
            "head_dim": 24,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
}
TOLERANCE = 1e-5


@in_child_process
def test_packed_rows_give_the_padded_logprobs_and_gradients(tmp_path: Path) -> None:
    one_rank_model_parallel(cuda=False)
    batch = make_batch(seed=4, lengths=LENGTHS, loss=LOSS, vocab_size=100)
    padded = pack(batch, CPU)
    packed = pack(batch, CPU, packed=True)
    assert padded is not None and packed is not None and packed.documents is not None
    assert packed.width == sum(n - 1 for n in LENGTHS) < padded.rows * padded.width
    for name, (family, options) in CASES.items():
        model_dir = write_tiny_checkpoint(tmp_path / name, family, seed=3, **options)
        with cpu_compat.active():
            model = built_model(model_dir, Attention.SDPA)
            assert documents.resolve(SequenceLayout.AUTO, model) is SequenceLayout.AUTO
            want, want_grads = run_layout(model, padded, LOSS)
            got, got_grads = run_layout(model, packed, LOSS)
            # Control: the same row as one causal sequence, attending across sequences.
            crossing, _ = run_layout(model, dataclasses.replace(packed, documents=None), LOSS)
        want = want[predicted(padded)]
        gap = (got[0] - want).abs().max().item()
        assert gap <= TOLERANCE, f"{name}: logprobs differ by {gap}"
        for g, w in zip(got_grads, want_grads, strict=True):
            scale = max(w.abs().max().item(), 1e-12)
            assert (g - w).abs().max().item() <= TOLERANCE * scale, f"{name}: gradients differ"
        miss = (crossing[0] - want).abs().max().item()
        assert miss > 100 * TOLERANCE, f"{name}: attention across sequences misses by {miss}"


@in_child_process
def test_each_layout_choice_packs_only_where_the_attention_keeps_sequences_apart(
    tmp_path: Path,
) -> None:
    one_rank_model_parallel(cuda=False)
    model_dir = write_tiny_checkpoint(tmp_path / "model", ModelFamily.LLAMA, seed=1)
    with cpu_compat.active():
        sdpa, local = (
            built_model(model_dir, Attention.SDPA),
            built_model(model_dir, Attention.LOCAL),
        )
    # The built model's norms run fused under bf16 (`runtime/norms.py`): every one swapped.
    found = [m for m in sdpa.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert found and all(isinstance(m, norms.ActivationDtypeRMSNorm) for m in found)
    assert documents.resolve(SequenceLayout.PACKED, sdpa) is SequenceLayout.PACKED
    cores = [m.core_attention for m in sdpa.modules() if hasattr(m, "core_attention")]
    assert cores and all(c.packed_attention is PackedAttention.AUTO for c in cores)
    # Each core attention gets the packed-row kernel asked for; a CPU rank attends sequence by
    # sequence whatever it is, so asking for cuDNN there is not refused.
    assert (
        documents.resolve(SequenceLayout.AUTO, sdpa, PackedAttention.CUDNN) is SequenceLayout.AUTO
    )
    assert all(c.packed_attention is PackedAttention.CUDNN for c in cores)
    documents.resolve(SequenceLayout.PACKED, sdpa, PackedAttention.FLASH)
    assert all(c.packed_attention is PackedAttention.FLASH for c in cores)
    assert documents.resolve(SequenceLayout.PADDED, sdpa) is SequenceLayout.PADDED
    assert documents.resolve(SequenceLayout.AUTO, local) is SequenceLayout.PADDED
    with pytest.raises(ValueError, match="DotProductAttention"):
        documents.resolve(SequenceLayout.PACKED, local)


def test_auto_packs_a_pass_only_where_its_padding_is_worth_it() -> None:
    auto, packed, padded = SequenceLayout.AUTO, SequenceLayout.PACKED, SequenceLayout.PADDED
    equal, mixed = np.array([9, 9, 9]), np.array([64, 4096, 900, 2000])
    slight = np.array([101, 111])  # padded rows compute 2 x 110 = 220 for 210 tokens: 1.05 x
    assert not documents.packs(auto, equal) and not documents.packs(auto, slight)
    assert documents.packs(auto, mixed)
    assert documents.packs(packed, equal) and not documents.packs(padded, mixed)


def test_packed_with_the_local_attention_is_refused_in_the_config() -> None:
    with pytest.raises(ValueError, match="--attention sdpa"):
        ModelConfig(attention=Attention.LOCAL, sequence_layout=SequenceLayout.PACKED)
    assert ModelConfig().sequence_layout is SequenceLayout.AUTO


def test_the_ragged_attention_says_why_it_cannot_run() -> None:
    """What `--packed-attention cudnn` is refused with on a GPU rank it cannot serve (the GPU
    test holds its results to the flash kernel's, tests/gpu/test_ragged_attention_gpu.py)."""
    cpu = torch.device("cpu")
    assert ragged_attention.unavailable(cpu, torch.bfloat16) == "it runs on a GPU only"
    assert not ragged_attention.applies(torch.zeros(4, 2, 8, dtype=torch.bfloat16), 0.0)
    if torch.cuda.is_available():
        reason = ragged_attention.unavailable(torch.device("cuda", 0), torch.float32)
        assert reason is not None and "float32" in reason


def test_ragged_graphs_are_keyed_by_buckets_of_the_row() -> None:
    """RL passes bring new counts and lengths each step; a graph serves every row in its
    buckets: counts and longest lengths up to a power of two (the table padded with empty
    sequences), the backward's token bound to a quarter of its power of two."""
    assert [ragged_attention._power_of_two(n) for n in (1, 3, 4, 5, 16, 17)] == [1, 4, 4, 8, 16, 32]
    assert [ragged_attention._quarter_octave(n) for n in (7, 9, 65536, 74948)] == [
        7,
        10,
        65536,
        81920,
    ]
    table = torch.tensor([0, 3, 5], dtype=torch.int32)
    assert ragged_attention._padded_table(table, 4).tolist() == [0, 3, 5, 5, 5]
    assert ragged_attention._padded_table(table, 2) is table


def test_a_row_whose_graphs_cannot_be_built_runs_another_kernel() -> None:
    """Where cuDNN cannot build a row's graphs (here: no GPU or frontend at all) `attention`
    says so before running anything, and the key is not tried again; `SdpaAttention` then runs
    the flash kernel. No pass stops half-way on one rank."""
    q = torch.zeros(6, 2, 8, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.zeros(6, 1, 8, dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    before = len(ragged_attention._unbuildable)
    assert ragged_attention.attention(q, k, v, cu_seqlens=cu, longest=4, scale=0.3) is None
    assert len(ragged_attention._unbuildable) == before + 1  # the forward's key, remembered
    assert ragged_attention.attention(q, k, v, cu_seqlens=cu, longest=4, scale=0.3) is None
    assert len(ragged_attention._unbuildable) == before + 1
