"""A trainer world's Forward against HF transformers on the same checkpoint (fp32): the check
that test_hf_parity runs per model family, and that other modules run on worlds they start
anyway."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from tests.support.batches import make_batch
from tests.support.trainer import TrainerProcess
from trainer_svc.domain import ForwardOutput, ForwardResult, LossConfig, SequenceBatch

PARITY_BATCH = make_batch(seed=2, lengths=[12, 31, 4, 18], loss=LossConfig())
PARITY_TOP_K = 4
TOLERANCE = 1e-4
"""Largest |trainer logprob - transformers logprob| accepted (fp32 on both sides)."""


def hf_logprobs(model_dir: Path, batch: SequenceBatch) -> np.ndarray:
    """Per-token log p(token | prefix) from transformers, 0 at each sequence's first token."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = np.zeros(batch.num_tokens, dtype=np.float32)
    with torch.no_grad():
        for start, end in zip(batch.offsets[:-1], batch.offsets[1:], strict=True):
            ids = torch.as_tensor(batch.tokens[start:end]).unsqueeze(0)
            logits = model(ids).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
            out[start + 1 : end] = logp.numpy()
    return out


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of every next token of `tokens` ([sequences, length])."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="sum"
    )


def hf_embedding_gradients(model_dir: Path, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' gradients of its input ("embedding") and output ("output") embeddings
    for `next_token_loss` (the same tensor when they are tied)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    next_token_loss(model(tokens).logits, tokens).backward()
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings().weight
    assert embedding.grad is not None and output.grad is not None
    return {"embedding": embedding.grad, "output": output.grad}


def parity_forward(process: TrainerProcess) -> ForwardResult:
    """Forward of `PARITY_BATCH` with every output; call it before the world trains, so that
    its weights are still the checkpoint's."""
    outputs = [ForwardOutput.LOGPROBS, ForwardOutput.ENTROPY, ForwardOutput.TOP_K]
    return process.client.forward(PARITY_BATCH, outputs, top_k=PARITY_TOP_K)


def assert_equals_transformers(result: ForwardResult, model_dir: Path) -> None:
    """`result` (of `parity_forward`) has transformers' logprobs on `model_dir`, a non-negative
    entropy and non-positive top-k logprobs at every predicted token."""
    expected = hf_logprobs(model_dir, PARITY_BATCH)
    assert result.logprobs is not None
    assert np.abs(result.logprobs - expected).max() <= TOLERANCE
    assert result.entropy is not None and (result.entropy >= 0).all()
    assert result.top_k_logprobs is not None
    predicted = np.setdiff1d(np.arange(PARITY_BATCH.num_tokens), PARITY_BATCH.offsets[:-1])
    assert (result.top_k_logprobs[predicted] <= 0).all()
