"""Packed rows on a GPU in bfloat16 (`--sequence-layout packed`: variable-length flash attention,
RoPE gathered at each token's own position): the model's logprobs and gradients are no further
from a float32 reference than padded rows in bfloat16 are. Prints both distances, the bf16
tolerance the docs state. Run on a lent GPU machine: ``python -m pytest -m gpu tests/gpu -s``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_hf.spec import ModelFamily
from megatron_hf.tiny import write_tiny_checkpoint
from tests.support.batches import make_batch
from tests.support.isolation import in_child_process
from tests.support.megatron_world import one_rank_model_parallel
from tests.support.sequence_layouts import built_model, predicted, run_layout
from trainer_svc.config import Attention, ParamsDType, SequenceLayout
from trainer_svc.domain import LossConfig, LossKind, Normalization
from trainer_svc.runtime import documents
from trainer_svc.runtime.packing import pack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LOSS = LossConfig(kind=LossKind.PPO, normalization=Normalization.SEQUENCE, kl_coef=0.1)


@in_child_process
def test_packed_bf16_rows_are_as_close_to_float32_as_padded_bf16_rows(tmp_path: Path) -> None:
    one_rank_model_parallel(cuda=True)
    cuda = torch.device("cuda")
    lengths = [300, 17, 511, 2, 128, 64]
    model_dir = write_tiny_checkpoint(
        tmp_path / "model",
        ModelFamily.LLAMA,
        seed=3,
        num_layers=2,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        max_position_embeddings=1024,
    )
    batch = make_batch(seed=4, lengths=lengths, loss=LOSS, vocab_size=100)
    padded, packed = pack(batch, cuda), pack(batch, cuda, packed=True)
    assert padded is not None and packed is not None
    results = {}
    for dtype in (ParamsDType.FLOAT32, ParamsDType.BFLOAT16):
        model = built_model(model_dir, Attention.SDPA, params_dtype=dtype, on_gpu=True)
        assert documents.resolve(SequenceLayout.PACKED, model)
        for name, laid_out in (("padded", padded), ("packed", packed)):
            logprobs, grads = run_layout(model, laid_out, LOSS)
            if name == "padded":
                logprobs = logprobs[predicted(padded)]
            results[dtype, name] = (logprobs.reshape(-1), grads)
    reference, reference_grads = results[ParamsDType.FLOAT32, "padded"]
    exact, _ = results[ParamsDType.FLOAT32, "packed"]
    assert (exact - reference).abs().max().item() <= 1e-4
    errors = {}
    for name in ("padded", "packed"):
        got, grads = results[ParamsDType.BFLOAT16, name]
        grad_error = max(
            ((g - w).norm() / w.norm().clamp(min=1e-12)).item()
            for g, w in zip(grads, reference_grads, strict=True)
        )
        errors[name] = ((got - reference).abs().max().item(), grad_error)
        print(
            f"bf16 {name}: max |logprob - fp32| {errors[name][0]:.3g}, largest relative "
            f"gradient error {errors[name][1]:.3g}"
        )
    for index in (0, 1):
        assert errors["packed"][index] <= 1.5 * errors["padded"][index] + 1e-3, errors
