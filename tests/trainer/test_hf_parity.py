"""Forward logprobs of the trainer equal HF transformers' on the same checkpoint (fp32), for the
Llama, Mistral, Qwen2 (QKV bias) and Qwen3 (q/k norm) families across parallel layouts."""

from __future__ import annotations

from typing import Any

import pytest

from megatron_hf.spec import ModelFamily
from megatron_hf.tiny import write_tiny_checkpoint
from tests.support.parity import assert_equals_transformers, parity_forward
from tests.support.trainer import TrainerProcess

CASES: dict[str, tuple[ModelFamily, dict[str, Any], list[str]]] = {
    "llama-tied-pp2": (ModelFamily.LLAMA, {"tie_word_embeddings": True}, ["--pp", "2"]),
    "qwen2-tp2": (ModelFamily.QWEN2, {}, ["--tp", "2"]),
    "qwen3-tp2": (ModelFamily.QWEN3, {"head_dim": 24}, ["--tp", "2"]),
    "mistral-pp2": (ModelFamily.MISTRAL, {"num_key_value_heads": 1}, ["--pp", "2"]),
}
CHECKED_ON_SHARED_WORLDS = {"llama-tied-pp2", "qwen2-tp2"}
"""Cases the default run checks on worlds that other checks start anyway, with the same batch
and assertions (`tests/support/parity.py`): a tied Llama at PP=2 in test_checkpoints, Qwen2 at
TP=2 in test_layouts. Their own worlds start in the slow run only."""
CHECKED_AGAINST_VLLM = {"qwen3-tp2", "mistral-pp2"}
"""Cases the default run checks against another reference: the fidelity matrix's Qwen3 at
trainer TP=2 and Mistral at PP=2 (tests/inference/test_fidelity_matrix.py, qwen3-yarn-gqa-tied
and mistral-mqa) hold the trainer's Forward to vLLM's own Qwen3 and Mistral at 1e-4. Here,
against transformers, in the slow run."""


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(name, marks=pytest.mark.slow)
        if name in CHECKED_ON_SHARED_WORLDS | CHECKED_AGAINST_VLLM
        else name
        for name in CASES
    ],
)
def test_forward_logprobs_equal_transformers(tmp_path, case):
    family, options, args = CASES[case]
    model_dir = write_tiny_checkpoint(tmp_path / "model", family, num_layers=2, seed=13, **options)
    process = TrainerProcess(tmp_path / "trainer", ["--model", str(model_dir), *args])
    try:
        result = parity_forward(process)
    finally:
        assert process.stop() == 0
    assert_equals_transformers(result, model_dir)
