"""The pad token's embedding row trains as in transformers, whose Llama, Qwen2 and Qwen3 build
their embedding as `nn.Embedding(vocab, hidden, padding_idx=pad_token_id)`: looking the pad
token up gives its row no gradient, the output layer still does, also when it is tied to the
embedding. The model the trainer builds (`model_factory.build_model`) against transformers on
the same checkpoint and batch, float32 on the CPU; the pad row on TP rank 0 of a TP=2 world:
tests/trainer/test_failed_commands.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_hf.spec import ModelFamily, ModelSpec, padded_vocab_size
from megatron_hf.tiny import write_tiny_checkpoint
from tests.support.isolation import in_child_process
from tests.support.megatron_world import one_rank_model_parallel
from tests.support.parity import hf_embedding_gradients, next_token_loss
from trainer_svc.config import ParallelLayout, ParamsDType
from trainer_svc.runtime import cpu_compat
from trainer_svc.runtime.model_factory import build_model
from trainer_svc.runtime.topology import Topology
from trainer_svc.runtime.weights import load_hf_weights

PAD = 0
TOKENS = [[5, PAD, 9, PAD, PAD, 7, 3, 12, PAD, 40], [PAD, PAD, 44, 8, PAD, 21, 2, PAD, 17, 5]]
"""The pad token where it is looked up and where it is predicted."""


def _trainer_gradients(model_dir: Path, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    spec = ModelSpec.from_pretrained_dir(model_dir)
    topology = Topology.from_parallel_state(ParallelLayout())
    padded = padded_vocab_size(spec.vocab_size, 1)
    with cpu_compat.active():
        model, _ = build_model(
            spec,
            topology,
            padded_vocab=padded,
            max_sequence_length=64,
            params_dtype=ParamsDType.FLOAT32,
            on_gpu=False,
        )
        load_hf_weights(model, model_dir, spec, topology, padded)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        logits = model(tokens, positions, None)[..., : spec.vocab_size]
        next_token_loss(logits, tokens).backward()
    embedding = model.embedding.word_embeddings.weight
    output = embedding if spec.tie_word_embeddings else model.output_layer.weight
    assert embedding.grad is not None and output.grad is not None
    vocab = spec.vocab_size
    return {"embedding": embedding.grad[:vocab], "output": output.grad[:vocab]}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@in_child_process
def test_the_pad_row_trains_as_in_transformers(tmp_path: Path, tied: bool) -> None:
    one_rank_model_parallel(cuda=False)
    model_dir = write_tiny_checkpoint(
        tmp_path / "model", ModelFamily.LLAMA, tie_word_embeddings=tied, seed=7
    )
    assert ModelSpec.from_pretrained_dir(model_dir).pad_token_id == PAD
    tokens = torch.tensor(TOKENS)
    want = hf_embedding_gradients(model_dir, tokens)
    got = _trainer_gradients(model_dir, tokens)
    for name in ("embedding", "output"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    if tied:  # the output layer trains the shared row, as HF's tied lm_head does
        assert want["embedding"][PAD].abs().max() > 0
    else:  # transformers freezes the row (the reason for this test), and so does the trainer
        assert not want["embedding"][PAD].any() and not got["embedding"][PAD].any()
        assert want["output"][PAD].abs().max() > 0
