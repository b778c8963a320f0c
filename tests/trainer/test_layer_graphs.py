"""CUDA graphs of the layers (`--cuda-graphs layers`) where there is no GPU: the flag reaches the
config, layouts it cannot run in are refused with their reasons, and a model with the
dispatcher installed computes exactly what it computed before for every pass it does not graph
(here all of them). The graphed path itself is held to the eager one on a GPU:
`tests/gpu/test_layer_graphs_gpu.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.isolation import in_child_process
from tests.support.megatron_world import cpu_model, lm_loss, one_rank_model_parallel
from trainer_svc.builtin_model import write_builtin_model
from trainer_svc.cli import parse_config
from trainer_svc.config import CudaGraphs, ModelConfig, Recompute
from trainer_svc.runtime import layer_graphs


@pytest.mark.parametrize("flag", [g.value for g in CudaGraphs])
def test_the_flag_chooses_the_graphs(flag: str) -> None:
    config, _ = parse_config(["--insecure", "--cuda-graphs", flag])
    assert config.model.cuda_graphs is CudaGraphs(flag)


def test_graphs_refuse_recompute() -> None:
    with pytest.raises(ValueError, match="recompute"):
        ModelConfig(cuda_graphs=CudaGraphs.LAYERS, recompute=Recompute.FULL)


def test_the_refusal_names_every_reason() -> None:
    ok = dict(on_gpu=True, tensor_parallel=1, pipeline_parallel=1, moe=False)
    assert layer_graphs.refusal(**ok) is None
    refused = layer_graphs.refusal(on_gpu=False, tensor_parallel=2, pipeline_parallel=2, moe=True)
    assert refused is not None
    for words in (
        "CUDA",
        "tensor parallelism (2)",
        "pipeline parallelism (2)",
        "experts",
    ):
        assert words in refused, refused


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="graph limit"):
        layer_graphs.GraphLimits(max_shapes=0)


@in_child_process
def test_passes_it_does_not_graph_are_unchanged(tmp_path: Path) -> None:
    from trainer_svc.runtime import cpu_compat

    one_rank_model_parallel(cuda=False)
    with cpu_compat.active():
        model, _, tokens = cpu_model(write_builtin_model(tmp_path / "model", seed=2))
        model.train()
        before = lm_loss(model, tokens)
        before.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        graphs = layer_graphs.install(model.decoder.layers)
        after = lm_loss(model, tokens)
        after.backward()
    assert torch.equal(after.detach(), before.detach())
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, grads[name]), name
    assert graphs.captures == 0 and graphs.replays == 0


def test_a_cpu_rank_refuses_the_graphs_at_start(tmp_path: Path) -> None:
    """The refusal reaches the rank's start-up (`build_engine`), before any model is built."""
    from trainer_svc.runtime.rank import build_engine

    config, _ = parse_config(["--insecure", "--cuda-graphs", "layers"])
    model_dir = write_builtin_model(tmp_path / "model", seed=2)
    with pytest.raises(ValueError, match="--cuda-graphs layers: it needs CUDA ranks"):
        build_engine(config, model_dir, torch.device("cpu"))
