"""Forward logprobs of the trainer equal HF transformers' on the same checkpoint (fp32), for the
Llama, Qwen2 (QKV bias) and Qwen3 (q/k norm) families across parallel layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_hf.spec import ModelFamily
from megatron_hf.tiny import write_tiny_checkpoint
from tests.support.batches import make_batch
from tests.support.trainer import TrainerProcess
from trainer_svc.domain import ForwardOutput, LossConfig, SequenceBatch

CASES = {
    "llama-tied-pp2": (ModelFamily.LLAMA, {"tie_word_embeddings": True}, ["--pp", "2"]),
    "qwen2-tp2": (ModelFamily.QWEN2, {}, ["--tp", "2"]),
    "qwen3-tp2": (ModelFamily.QWEN3, {"head_dim": 24}, ["--tp", "2"]),
}


def hf_logprobs(model_dir, batch: SequenceBatch) -> np.ndarray:
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


@pytest.mark.parametrize("case", list(CASES))
def test_forward_logprobs_equal_transformers(tmp_path, case):
    family, options, args = CASES[case]
    model_dir = write_tiny_checkpoint(tmp_path / "model", family, num_layers=2, seed=13, **options)
    batch = make_batch(seed=2, lengths=[12, 31, 4, 18], loss=LossConfig())
    process = TrainerProcess(tmp_path / "trainer", ["--model", str(model_dir), *args])
    try:
        result = process.client.forward(
            batch, [ForwardOutput.LOGPROBS, ForwardOutput.ENTROPY, ForwardOutput.TOP_K], top_k=4
        )
    finally:
        assert process.stop() == 0
    expected = hf_logprobs(model_dir, batch)
    assert np.abs(result.logprobs - expected).max() <= 1e-4
    assert result.entropy is not None and (result.entropy >= 0).all()
    firsts = batch.offsets[:-1]
    assert (result.top_k_logprobs[np.setdiff1d(np.arange(batch.num_tokens), firsts)] <= 0).all()
