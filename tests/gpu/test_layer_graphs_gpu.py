"""CUDA graphs of the layers (`runtime/layer_graphs.py`, `--cuda-graphs layers`) on a GPU in
bfloat16: a graphed training pass computes the eager pass's logprobs and every parameter's
gradient, the first pass of a shape captures and later ones replay, and what is not eligible
(a packed row, a pass without gradients) runs eagerly. Prints the distances, and the host time
of a pass both ways (printed, not asserted: BENCHMARKS.md's `graphs` rows measure speed). Run on
a lent GPU machine: ``python -m pytest -m gpu tests/gpu -s``."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from megatron_hf.spec import ModelFamily
from megatron_hf.tiny import write_tiny_checkpoint
from tests.support.batches import make_batch
from tests.support.isolation import in_child_process
from tests.support.megatron_world import one_rank_model_parallel
from tests.support.sequence_layouts import built_model, run_layout
from trainer_svc.config import Attention, ParamsDType, SequenceLayout
from trainer_svc.domain import LossConfig, LossKind, Normalization
from trainer_svc.runtime import documents, layer_graphs
from trainer_svc.runtime.losses import loss_sums
from trainer_svc.runtime.packing import pack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LOSS = LossConfig(kind=LossKind.PPO, normalization=Normalization.SEQUENCE, kl_coef=0.1)


def _model(tmp_path: Path, layers: int) -> torch.nn.Module:
    """A bf16 Llama-family model of `layers` layers on GPU 0, in a one-rank world."""
    one_rank_model_parallel(cuda=True)
    model_dir = write_tiny_checkpoint(
        tmp_path / "model",
        ModelFamily.LLAMA,
        seed=3,
        num_layers=layers,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        max_position_embeddings=1024,
    )
    return built_model(model_dir, Attention.SDPA, params_dtype=ParamsDType.BFLOAT16, on_gpu=True)


def _timed(model: torch.nn.Module, batch, passes: int = 5) -> float:
    """Median wall time of a training pass, the device drained before and after each."""
    times = []
    for _ in range(passes):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run_layout(model, batch, LOSS)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@in_child_process
def test_graphed_passes_equal_eager_ones(tmp_path: Path) -> None:
    cuda = torch.device("cuda")
    model = _model(tmp_path, layers=6)
    # the packed row's RoPE
    assert documents.resolve(SequenceLayout.PACKED, model) is SequenceLayout.PACKED
    model.train()
    padded = pack(make_batch(seed=4, lengths=[200, 180, 31], loss=LOSS, vocab_size=100), cuda)
    other = pack(make_batch(seed=5, lengths=[64], loss=LOSS, vocab_size=100), cuda)
    packed = pack(
        make_batch(seed=6, lengths=[40, 17, 90], loss=LOSS, vocab_size=100), cuda, packed=True
    )
    assert padded is not None and other is not None and packed is not None
    eager = {name: run_layout(model, b, LOSS) for name, b in (("padded", padded), ("other", other))}
    eager_packed = run_layout(model, packed, LOSS)
    eager_s = _timed(model, padded)

    graphs = layer_graphs.install(model.decoder.layers)
    for round_ in range(2):
        for name, batch in (("padded", padded), ("other", other)):
            logprobs, grads = run_layout(model, batch, LOSS)
            want_logprobs, want_grads = eager[name]
            logprob_gap = (logprobs - want_logprobs).abs().max().item()
            grad_gap = max(
                ((g - w).norm() / w.norm().clamp(min=1e-12)).item()
                for g, w in zip(grads, want_grads, strict=True)
            )
            print(
                f"graphed {name} pass {round_}: max |logprob - eager| {logprob_gap:.3g}, "
                f"largest relative gradient gap {grad_gap:.3g}"
            )
            assert logprob_gap <= 1e-6 and grad_gap <= 1e-6, (name, logprob_gap, grad_gap)
    assert graphs.captures == 2  # one per shape
    assert graphs.replays == 4

    # Not eligible: a packed row, and a pass without gradients.
    logprobs, grads = run_layout(model, packed, LOSS)
    assert torch.equal(logprobs, eager_packed[0])
    with torch.no_grad():
        model(padded.inputs, padded.positions, None)
    assert graphs.captures == 2 and graphs.replays == 4

    graphed_s = _timed(model, padded)
    print(
        f"a training pass of {tuple(padded.inputs.shape)} tokens through 6 layers: "
        f"eager {eager_s * 1e3:.2f} ms, graphed {graphed_s * 1e3:.2f} ms"
    )


@in_child_process
def test_graphs_add_gradients_into_main_grad_as_ddp_does(tmp_path: Path) -> None:
    """With a `main_grad` on every layer parameter (what megatron's DDP gives them), the
    backward graphs add into it and leave `grad` unset: the main gradients after two graphed
    passes equal the sum of two eager passes' gradients, in float32."""
    cuda = torch.device("cuda")
    model = _model(tmp_path, layers=4)
    model.train()
    batch = pack(make_batch(seed=4, lengths=[200, 180, 31], loss=LOSS, vocab_size=100), cuda)
    assert batch is not None
    layer_params = [p for layer in model.decoder.layers for p in layer.parameters()]
    _, eager = run_layout(model, batch, LOSS)
    by_id = {id(p): g for p, g in zip(model.parameters(), eager, strict=True)}
    expected = [2 * by_id[id(p)] for p in layer_params]  # two passes of the same batch
    for p in layer_params:
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    graphs = layer_graphs.install(model.decoder.layers)
    assert graphs.main_grads
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        logits = model(batch.inputs, batch.positions, None)
        picked = torch.log_softmax(logits.float(), dim=-1).gather(-1, batch.targets.unsqueeze(-1))
        loss_sums(picked.squeeze(-1), batch.token_inputs, LOSS)["loss"].backward()
        assert all(p.grad is None for p in layer_params)
    assert graphs.captures == 1 and graphs.replays == 2
    for p, want in zip(layer_params, expected, strict=True):
        assert torch.equal(p.main_grad, want), (tuple(p.shape), (p.main_grad - want).abs().max())
