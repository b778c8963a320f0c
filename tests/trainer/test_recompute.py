"""Activation recompute (`--recompute`): the backward pass really recomputes (core attention
for selective, every layer for full) and the gradients equal those of a pass that kept its
activations, bit for bit on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.isolation import in_child_process
from tests.support.megatron_world import cpu_model, lm_loss, one_rank_model_parallel
from trainer_svc.builtin_model import write_builtin_model
from trainer_svc.cli import parse_config
from trainer_svc.config import Recompute


@in_child_process
def test_recompute_reruns_the_forward_and_changes_no_gradient(model_dir: Path) -> None:
    from trainer_svc.runtime import cpu_compat

    one_rank_model_parallel(cuda=False)
    with cpu_compat.active():  # megatron's CUDA calls (rotary, checkpointing) on the CPU
        _compare_recomputes(model_dir)


def _compare_recomputes(model_dir: Path) -> None:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from trainer_svc.runtime.sdpa_attention import SdpaAttention

    reference: dict[str, torch.Tensor] = {}
    for recompute in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL):
        model, _, tokens = cpu_model(model_dir, recompute=recompute)
        layers = len([m for m in model.modules() if isinstance(m, TransformerLayer)])
        assert layers > 0
        if reference:
            model.load_state_dict(reference["weights"], strict=False)
        calls = {TransformerLayer: 0, SdpaAttention: 0}

        def count(module: torch.nn.Module, *_: object) -> None:
            calls[type(module)] += 1  # noqa: B023 (each model counts into its own dict)

        for module in model.modules():
            if type(module) in calls:
                module.register_forward_hook(count)
        loss = lm_loss(model, tokens)
        forward = dict(calls)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        assert forward == {TransformerLayer: layers, SdpaAttention: layers}
        again = {k: calls[k] - forward[k] for k in calls}
        expected = {
            Recompute.NONE: {TransformerLayer: 0, SdpaAttention: 0},
            Recompute.SELECTIVE: {TransformerLayer: 0, SdpaAttention: layers},
            Recompute.FULL: {TransformerLayer: layers, SdpaAttention: layers},
        }[recompute]
        assert again == expected, f"{recompute}: ran again in the backward {again}"
        if not reference:
            reference.update(weights=model.state_dict(), loss=loss.detach())
            reference.update({f"grad:{n}": g for n, g in grads.items()})
            continue
        assert torch.equal(loss.detach(), reference["loss"])
        for name, grad in grads.items():
            assert torch.equal(grad, reference[f"grad:{name}"]), f"{recompute}: {name}"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_builtin_model(tmp_path / "model", seed=2)


@pytest.mark.parametrize("flag", [r.value for r in Recompute])
def test_the_flag_chooses_the_recompute(flag: str) -> None:
    config, _ = parse_config(["--insecure", "--recompute", flag])
    assert config.model.recompute is Recompute(flag)
