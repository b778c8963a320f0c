"""Routing replay (R3) against a real vLLM engine: the engine reports the experts its routers
chose for each prompt token (`RefitEngine.probe_routing`), and the trainer's Forward, replaying
them, gives vLLM's logprobs more closely than its own routing does.

The two sides hold the same experts but slightly different routers (the trainer's perturbed),
as a trainer and its sampler do after numerics drift: enough for some tokens to be routed to
other experts without replay, while the gate probabilities at any given experts barely move.
Without replay those tokens' logprobs differ by what another expert computes; with it, by the
perturbation alone. With replay disabled the two Forwards would be the same and the test fails.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_hf.spec import ModelFamily
from megatron_hf.tiny import TINY_EXPERTS, write_tiny_checkpoint
from tests.support.engine import EngineProcess
from tests.support.trainer import TrainerProcess
from trainer_svc.domain import ForwardOutput, SequenceBatch

PROMPTS = [
    [int(t) for t in np.random.default_rng(seed).integers(1, 100, size=length)]
    for seed, length in ((1, 14), (2, 9), (3, 17), (4, 12))
]
ROUTER_NOISE = 0.01
"""Relative size of the trainer's router perturbation."""
EXPERT_GAIN = 8.0
"""The tiny checkpoint's experts scaled up so that which expert a token reaches shows in its
logprobs well above the perturbation's own effect."""


def _scaled(tensors: dict[str, torch.Tensor], path: Path) -> None:
    for name, tensor in tensors.items():
        if ".mlp.experts." in name and name.endswith("down_proj.weight"):
            tensors[name] = tensor * EXPERT_GAIN
    save_file(tensors, path, metadata={"format": "pt"})


def _perturbed(model_dir: Path, target: Path) -> Path:
    """A copy of `model_dir` whose routers are perturbed by ROUTER_NOISE of their scale."""
    shutil.copytree(model_dir, target)
    path = target / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(11)
    for name, tensor in tensors.items():
        if name.endswith("mlp.gate.weight"):
            noise = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
            tensors[name] = tensor + ROUTER_NOISE * tensor.std() * noise
    save_file(tensors, path, metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def sides(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[EngineProcess, TrainerProcess]]:
    root = tmp_path_factory.mktemp("replay-vllm")
    model_dir = write_tiny_checkpoint(
        root / "model",
        ModelFamily.QWEN3_MOE,
        num_layers=2,
        seed=5,
        experts=TINY_EXPERTS,
        head_dim=32,  # vLLM-CPU attention needs at least 32
    )
    path = model_dir / "model.safetensors"
    _scaled(load_file(path), path)
    engine = EngineProcess(model_dir, 1, root / "engine.log")
    trainer = TrainerProcess(root / "trainer", ["--model", str(_perturbed(model_dir, root / "b"))])
    try:
        engine.wait_ready()
        yield engine, trainer
    finally:
        trainer.stop()
        engine.stop()


def _flat(routed: list[np.ndarray]) -> np.ndarray:
    """Per-prompt [tokens, layers, top_k] as the trainer takes it: [tokens, layers * top_k]."""
    return np.concatenate([r.reshape(r.shape[0], -1) for r in routed])


def test_replaying_vllms_routing_gives_vllms_logprobs_more_closely(sides):
    engine, trainer = sides
    probed = engine.call("probe_routing", PROMPTS)
    vllm_logprobs = [np.asarray(logprobs) for logprobs, _ in probed]
    vllm_routed = [routed for _, routed in probed]
    layers, top_k = 2, TINY_EXPERTS.top_k
    assert [r.shape for r in vllm_routed] == [(len(p), layers, top_k) for p in PROMPTS]

    batch = SequenceBatch.from_lists(PROMPTS, loss_mask=[[True] * len(p) for p in PROMPTS])
    outputs = (ForwardOutput.LOGPROBS, ForwardOutput.ROUTED_EXPERTS)
    free = trainer.client.forward(batch, outputs)
    replayed = trainer.client.forward(
        SequenceBatch.from_lists(
            PROMPTS, loss_mask=[[True] * len(p) for p in PROMPTS], routed_experts=vllm_routed
        ),
        outputs,
    )
    assert free.logprobs is not None and replayed.logprobs is not None
    assert free.routed_experts is not None and replayed.routed_experts is not None
    # Every input token (a prompt's last token is none): its experts as sets per layer.
    inputs = np.ones(batch.num_tokens, dtype=bool)
    inputs[batch.offsets[1:] - 1] = False
    vllm_sets = np.sort(_flat(vllm_routed).reshape(-1, layers, top_k), axis=-1)[inputs]
    free_sets = np.sort(free.routed_experts.reshape(-1, layers, top_k), axis=-1)[inputs]
    replayed_sets = np.sort(replayed.routed_experts.reshape(-1, layers, top_k), axis=-1)[inputs]
    flipped = int((vllm_sets != free_sets).any(axis=-1).sum())
    assert flipped > 0, "the perturbation routed every token alike: the test would prove nothing"
    assert np.array_equal(replayed_sets, vllm_sets)

    bounds = np.cumsum([0, *map(len, PROMPTS)])

    def gap(logprobs: np.ndarray) -> float:
        return max(
            float(np.abs(logprobs[start + 1 : stop] - truth).max())
            for start, stop, truth in zip(bounds[:-1], bounds[1:], vllm_logprobs, strict=True)
        )

    with_replay, without = gap(replayed.logprobs), gap(free.logprobs)
    print(
        f"{flipped} of {vllm_sets.shape[0] * layers} routing choices differ; "
        f"|trainer - vLLM| {with_replay:.2e} replayed, "
        f"{without:.2e} on the trainer's own routing"
    )
    assert with_replay < 0.5 * without
