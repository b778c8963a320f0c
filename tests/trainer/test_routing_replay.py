"""Routing replay on a Qwen3-MoE trainer (top-2 of 8 experts, one rank, the padded layout so
that a pass holds padding too): Forward reports each token's experts per layer; replaying
them changes nothing (to rounding); replaying other routing gives what transformers computes
when its routers are made to route so, and not what the router's own choice gives; a step
replaying the routing it would choose anyway equals the step without replay, and one
replaying other routing trains differently; routing of the wrong shape, an expert outside the
model or one expert twice is refused and changes nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from megatron_hf.spec import ModelFamily
from megatron_hf.tiny import TINY_EXPERTS, write_tiny_checkpoint
from tests.support.batches import make_batch
from tests.support.trainer import TrainerProcess, max_relative_difference
from trainer_svc.domain import (
    ForwardOutput,
    InvalidArgument,
    LossConfig,
    OptimizerOverrides,
    SequenceBatch,
)

LAYERS = 2
K, EXPERTS = TINY_EXPERTS.top_k, TINY_EXPERTS.num_experts
BATCH = make_batch(seed=11, lengths=[9, 14, 6], loss=LossConfig())
OPTIMIZER = OptimizerOverrides(learning_rate=1e-3, adam_eps=1e-4)  # no sign noise (test_split_step)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainerProcess]:
    workdir = tmp_path_factory.mktemp("routing-replay")
    model_dir = write_tiny_checkpoint(
        workdir / "model", ModelFamily.QWEN3_MOE, num_layers=LAYERS, seed=3
    )
    process = TrainerProcess(workdir, ["--model", str(model_dir), "--sequence-layout", "padded"])
    process.model_dir = model_dir  # type: ignore[attr-defined]
    process.client.save_checkpoint(workdir / "base")
    try:
        yield process
    finally:
        assert process.stop() == 0


def _routed(trainer: TrainerProcess, batch: SequenceBatch = BATCH) -> np.ndarray:
    result = trainer.client.forward(batch, (ForwardOutput.ROUTED_EXPERTS,))
    assert result.routed_experts is not None
    return result.routed_experts


def _with(batch: SequenceBatch, routing: np.ndarray) -> SequenceBatch:
    return dataclasses.replace(batch, routed_experts=routing.reshape(batch.num_tokens, -1))


def _other(routing: np.ndarray) -> np.ndarray:
    """Every token's second expert in layer 0 swapped for the next one it did not choose."""
    other = routing.copy()
    for row in other[:, 0]:
        replacement = next(e for e in range(EXPERTS) if e not in row)
        row[1] = replacement
    return other


def _inputs(batch: SequenceBatch) -> np.ndarray:
    inputs = np.ones(batch.num_tokens, dtype=bool)
    inputs[batch.offsets[1:] - 1] = False
    return inputs


def _forced_logprobs(model_dir: Path, batch: SequenceBatch, routing: np.ndarray) -> np.ndarray:
    """transformers' per-token logprobs with each layer's router made to pick `routing`'s
    experts (its probabilities taken at them, as the router's own choice would be)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = np.zeros(batch.num_tokens, dtype=np.float32)
    for start, end in zip(batch.offsets[:-1], batch.offsets[1:], strict=True):
        for layer, block in enumerate(model.model.layers):
            gate = block.mlp.gate
            chosen = torch.as_tensor(routing[start:end, layer].copy())
            chosen[-1] = torch.arange(K)  # the last token is no input: any distinct experts

            def forward(hidden: torch.Tensor, gate=gate, chosen=chosen) -> tuple:
                hidden = hidden.reshape(-1, gate.hidden_dim)
                logits = F.linear(hidden, gate.weight)
                probs = torch.softmax(logits, dtype=torch.float, dim=-1).gather(1, chosen)
                if gate.norm_topk_prob:
                    probs = probs / probs.sum(dim=-1, keepdim=True)
                return logits, probs.to(logits.dtype), chosen

            gate.forward = forward
        ids = torch.as_tensor(batch.tokens[start:end]).unsqueeze(0)
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
        out[start + 1 : end] = logp.numpy()
    return out


def test_forward_reports_each_tokens_experts_and_replaying_them_changes_nothing(trainer):
    routing = _routed(trainer)
    assert routing.shape == (BATCH.num_tokens, LAYERS, K)
    used = routing[_inputs(BATCH)]
    assert used.min() >= 0 and used.max() < EXPERTS
    assert (np.sort(used, axis=-1)[..., 1:] != np.sort(used, axis=-1)[..., :-1]).all()
    assert not routing[~_inputs(BATCH)].any()
    free = trainer.client.forward(BATCH).logprobs
    replayed = trainer.client.forward(_with(BATCH, routing)).logprobs
    # Equal up to float rounding: the replayed probabilities are gathered, not top-k'd.
    assert float(np.abs(replayed - free).max()) <= 1e-6


def test_replayed_routing_computes_what_transformers_routed_alike_does(trainer):
    other = _other(_routed(trainer))
    replayed = trainer.client.forward(_with(BATCH, other), (ForwardOutput.LOGPROBS,))
    recorded = trainer.client.forward(
        _with(BATCH, other), (ForwardOutput.LOGPROBS, ForwardOutput.ROUTED_EXPERTS)
    )
    assert recorded.routed_experts is not None
    assert np.array_equal(recorded.routed_experts[_inputs(BATCH)], other[_inputs(BATCH)])
    forced = _forced_logprobs(trainer.model_dir, BATCH, other)
    free = trainer.client.forward(BATCH).logprobs
    gap = float(np.abs(replayed.logprobs - forced).max())
    unreplayed = float(np.abs(free - forced).max())
    print(f"replayed vs transformers routed alike {gap:.2e}; without replay {unreplayed:.2e}")
    assert gap <= 1e-4
    assert unreplayed > 1e-3  # the routing differs: without replay the test would fail


def _step(trainer: TrainerProcess, name: str, batch: SequenceBatch) -> dict[str, np.ndarray]:
    trainer.client.load_checkpoint(trainer.workdir / "base")
    trainer.client.begin_step(name, LossConfig(), OPTIMIZER)
    trainer.client.train_microbatch(name, "m", batch)
    trainer.client.finish_step(name)
    return trainer.export(name)


def test_a_step_trains_with_the_routing_it_replays(trainer):
    trainer.client.load_checkpoint(trainer.workdir / "base")
    own = _routed(trainer)
    free = _step(trainer, "free", BATCH)
    same = _step(trainer, "replaying-its-own", _with(BATCH, own))
    other = _step(trainer, "replaying-other", _with(BATCH, _other(own)))
    same_gap = max_relative_difference(same, free)
    other_gap = max_relative_difference(other, free)
    print(f"replaying its own routing {same_gap:.2e}, other routing {other_gap:.2e}")
    assert same_gap <= 1e-5
    assert other_gap > 100 * max(same_gap, 1e-7)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r[:, :1], "the model needs num_tokens x num_layers x top_k"),
        (lambda r: np.where(r == r.max(), EXPERTS, r), f"the model has {EXPERTS}"),
        (lambda r: np.repeat(r[..., :1], K, axis=-1), "names one expert twice"),
    ],
)
def test_bad_routing_is_refused_and_changes_nothing(trainer, change, message):
    trainer.client.load_checkpoint(trainer.workdir / "base")
    before = trainer.client.status().weights_version
    bad = change(_routed(trainer))
    batch = dataclasses.replace(BATCH, routed_experts=bad.reshape(BATCH.num_tokens, -1))
    with pytest.raises(InvalidArgument, match=message):
        trainer.client.forward(batch)
    trainer.client.begin_step("bad-routing", LossConfig(), OPTIMIZER)
    with pytest.raises(InvalidArgument, match=message):
        trainer.client.train_microbatch("bad-routing", "m", batch)
    trainer.client.abort_step("bad-routing")
    assert trainer.client.status().weights_version == before
