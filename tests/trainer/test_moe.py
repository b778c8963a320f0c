"""Qwen3-MoE and Mixtral through the service, on megatron-core's MoE layers: Forward equals
transformers' (which loads the per-expert checkpoint into its fused expert tensors itself) at
EP=1 and at EP=2 over two data-parallel ranks, one Qwen3-MoE model (over two pipeline stages,
its routers frozen) routing every token to every expert so that no routing flip can hide a
misplaced expert; ExportHF gives back the
source checkpoint bit for bit; a step streamed in pieces equals the step sent whole, with the
load-balancing loss off and on, while the two data-parallel ranks run different numbers of
passes; a layout the experts cannot be split into is refused at start. The EP=2 worlds publish
every version to a sidecar, each layer's experts grouped into one fc1 and one fc2 tensor whose
pulled bytes equal ExportHF's experts, every shard naming its expert rank."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_hf.checkpoint import load_hf_state_dict
from megatron_hf.experts import grouped_expert_name, hf_expert_names
from megatron_hf.spec import ModelFamily, MoESpec
from megatron_hf.tiny import TINY_EXPERTS, write_tiny_checkpoint
from refit_sidecar.core.manifest import Manifest
from refit_sidecar.core.plan import plan_pull, whole
from refit_sidecar.memory.region import Region
from refit_sidecar.pull.nixl_transport import NixlConfig, NixlTransport
from tests.support.batches import make_batch, split
from tests.support.parity import (
    PARITY_BATCH,
    assert_equals_transformers,
    hf_logprobs,
    parity_forward,
)
from tests.support.sidecar import Sidecar, running_sidecar
from tests.support.trainer import (
    TEST_ENV,
    TrainerProcess,
    max_relative_difference,
    start_trainers,
    stop_trainers,
)
from trainer_svc.domain import (
    ForwardOutput,
    ForwardResult,
    LossConfig,
    LossKind,
    Normalization,
    OptimizerOverrides,
    ReferenceSource,
    StepMetrics,
)

EVERY_EXPERT = MoESpec(num_experts=8, top_k=8, ffn_hidden_size=32, norm_topk_prob=True)
"""Top-k = all experts: every token's output depends on every expert's weights, so a layout
error cannot hide behind a routing decision that happens to avoid the misplaced expert."""
TWO_RANKS = ["--dp", "2", "--ep", "2", "--pass-token-budget", "40"]
"""Experts 0-3 on rank 0, 4-7 on rank 1; the budget cuts each rank's share into passes, a
different number on each rank for the step's batch."""
AUX_LOSS = ["--moe-aux-loss-coeff", "0.1"]
QWEN3_MOE = ModelFamily.QWEN3_MOE
MIXTRAL = ModelFamily.MIXTRAL
PUBLISHING = ("qwen3-moe-pp2-ep2-every-expert", "mixtral-ep2-aux-loss")
"""Worlds that publish every version to the module's sidecar."""
WORLDS: dict[str, tuple[ModelFamily, MoESpec, list[str]]] = {
    "mixtral-ep1-aux-loss": (MIXTRAL, TINY_EXPERTS, ["--pass-token-budget", "40", *AUX_LOSS]),
    "qwen3-moe-pp2-ep2-every-expert": (
        QWEN3_MOE,
        EVERY_EXPERT,
        ["--pp", "2", *TWO_RANKS, "--moe-freeze-router"],
    ),
    "mixtral-ep2-aux-loss": (MIXTRAL, TINY_EXPERTS, [*TWO_RANKS, *AUX_LOSS]),
}
LOSS = LossConfig(kind=LossKind.PPO, normalization=Normalization.TOKEN, kl_coef=0.1)
OPTIMIZER = OptimizerOverrides(learning_rate=1e-3, adam_eps=1e-4)  # see test_split_step
LENGTHS = [9, 17, 5, 12, 30, 7, 21]


@dataclass(frozen=True)
class World:
    model_dir: Path
    parity: ForwardResult
    exported: dict[str, np.ndarray]
    """ExportHF of the weights as loaded, in the trainer's own dtype."""
    base: dict[str, np.ndarray]
    whole: dict[str, np.ndarray]
    """After one step of the batch sent whole, and streamed in three pieces."""
    pieces: dict[str, np.ndarray]
    metrics: tuple[StepMetrics, StepMetrics]
    """Of the step sent whole, and streamed in pieces."""
    published: tuple[Manifest, dict[str, np.ndarray]] | None
    """The manifest of the version after the streamed step, and every tensor of it pulled
    whole; None where the world publishes nowhere."""


def _step(
    process: TrainerProcess, name: str, sizes: list[int]
) -> tuple[dict[str, np.ndarray], StepMetrics, int]:
    process.client.load_checkpoint(process.workdir / "base")
    batch = make_batch(seed=7, lengths=LENGTHS, loss=LOSS)
    process.client.begin_step(name, LOSS, OPTIMIZER)
    for i, part in enumerate(split(batch, sizes)):
        process.client.train_microbatch(name, f"{name}-{i}", part)
    result = process.client.finish_step(name, wait_for_publication=True)
    return process.export(name), result.metrics, result.weights_version


def _pull_whole(sidecar: Sidecar, version: int) -> tuple[Manifest, dict[str, np.ndarray]]:
    """Every tensor of `version`, pulled whole from the trainer's ranks and checked."""
    transport = NixlTransport.create(NixlConfig(name=f"moe-puller-{version}", pull_timeout_s=60))
    try:
        with sidecar.client() as client:
            client.wait_visible(version)
            manifest = client.manifest(version)
            lease = client.acquire_lease(version, f"moe-test-{version}", ttl=60)
            plan = plan_pull(manifest, whole(manifest))
            staging = np.zeros(plan.nbytes, np.uint8)
            stats = transport.pull(plan, Region.of_array(staging), verify=True)
            client.release_lease(lease)
    finally:
        transport.close()
    assert stats.verified_shards == len(plan.reads) > 0
    tensors = {t.name: staging[t.span].view(np.float32).reshape(t.box.shape) for t in plan.targets}
    return manifest, tensors


def _run(process: TrainerProcess, model_dir: Path, sidecar: Sidecar | None) -> World:
    parity = parity_forward(process)
    exported = process.export("as-loaded")
    process.client.save_checkpoint(process.workdir / "base")
    # A Forward between the steps: its routing counts for no step.
    process.client.forward(make_batch(seed=8, lengths=[6, 9], loss=LOSS))
    whole, whole_metrics, _ = _step(process, "whole", [len(LENGTHS)])
    pieces, pieces_metrics, version = _step(process, "pieces", [1, 4, 2])
    published = None if sidecar is None else _pull_whole(sidecar, version)
    metrics = (whole_metrics, pieces_metrics)
    return World(model_dir, parity, exported, exported, whole, pieces, metrics, published)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, World]]:
    root = tmp_path_factory.mktemp("moe")
    models = {
        (family, experts): write_tiny_checkpoint(
            root / f"{family.value}-top{experts.top_k}",
            family,
            num_layers=2,
            seed=5,
            experts=experts,
        )
        for family, experts, _ in WORLDS.values()
    }
    with contextlib.ExitStack() as stack:
        # A sidecar serves one trainer: one per publishing world.
        sidecars = {
            name: stack.enter_context(running_sidecar(root / f"{name}-sidecar"))
            for name in PUBLISHING
        }
        processes = start_trainers(
            {
                name: (
                    root / name,
                    [
                        "--model",
                        str(models[(family, experts)]),
                        *args,
                        *(sidecars[name].trainer_args() if name in sidecars else []),
                    ],
                )
                for name, (family, experts, args) in WORLDS.items()
            }
        )
        try:
            yield {
                name: _run(process, models[(WORLDS[name][0], WORLDS[name][1])], sidecars.get(name))
                for name, process in processes.items()
            }
        finally:
            assert stop_trainers(processes.values()) == [0] * len(processes)


@pytest.mark.parametrize("world", list(WORLDS))
def test_forward_equals_transformers(worlds, world):
    result, model_dir = worlds[world].parity, worlds[world].model_dir
    gap = np.abs(result.logprobs - hf_logprobs(model_dir, PARITY_BATCH)).max()
    print(f"{world}: max |trainer - transformers| logprob {gap:.2e}")
    assert_equals_transformers(result, model_dir)


@pytest.mark.parametrize("world", list(WORLDS))
def test_export_gives_back_the_source_checkpoint_bit_for_bit(worlds, world):
    """The same per-expert tensors in the files, and the same fused expert tensors once
    transformers loads both directories."""
    exported, model_dir = worlds[world].exported, worlds[world].model_dir
    source = load_hf_state_dict(model_dir)
    assert exported.keys() == source.keys()
    for name, tensor in source.items():
        assert np.array_equal(exported[name], tensor.numpy()), name
    export_dir = next((model_dir.parent / world / "exports").glob("as-loaded"))
    loaded = [
        AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).state_dict()
        for d in (model_dir, export_dir)
    ]
    assert loaded[0].keys() == loaded[1].keys()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in loaded[0])  # fused in memory
    for name, tensor in loaded[0].items():
        assert torch.equal(tensor, loaded[1][name]), name


@pytest.mark.parametrize("world", list(WORLDS))
def test_a_streamed_step_equals_the_step_sent_whole(worlds, world):
    run = worlds[world]
    moved = max_relative_difference(run.whole, run.base)
    gap = max_relative_difference(run.pieces, run.whole)
    print(f"{world}: step moved weights by {moved:.2e}, pieces vs whole gap {gap:.2e}")
    assert moved > 1e-3
    assert gap <= 1e-5


def test_a_frozen_router_keeps_its_weights_while_the_experts_train(worlds):
    run = worlds["qwen3-moe-pp2-ep2-every-expert"]
    for layer in range(2):
        router = f"model.layers.{layer}.mlp.gate.weight"
        expert = f"model.layers.{layer}.mlp.experts.6.down_proj.weight"
        assert np.array_equal(run.whole[router], run.base[router])
        assert not np.array_equal(run.whole[expert], run.base[expert])


def test_two_ranks_train_as_one(worlds):
    """The same checkpoint and step (load-balancing loss on) at EP=1 on one rank and at EP=2
    over two data-parallel ranks, whose passes differ, give the same update."""
    one, two = worlds["mixtral-ep1-aux-loss"], worlds["mixtral-ep2-aux-loss"]
    gap = max_relative_difference(two.whole, one.whole)
    print(f"EP=2 vs EP=1 after one step: {gap:.2e}")
    assert gap <= 1e-5


@pytest.mark.parametrize("world", list(WORLDS))
def test_the_step_reports_each_layers_expert_load_and_the_switch_loss(worlds, world):
    """Every input token of the step is routed to top-k experts in each layer, so an expert
    gets top_k * tokens / experts on average; with top-k = every expert each gets every token
    and the Switch loss is exactly 1. A step streamed in pieces routes what the whole one
    does; a Forward before them counts for neither."""
    experts = WORLDS[world][1]
    whole, pieces = worlds[world].metrics
    inputs = sum(length - 1 for length in LENGTHS)
    mean = experts.top_k * inputs / experts.num_experts
    assert [e.layer for e in whole.expert_load] == [0, 1]
    for load in whole.expert_load:
        assert load.mean_tokens == pytest.approx(mean, rel=1e-12)
        assert load.max_tokens >= load.mean_tokens
    assert pieces.expert_load == whole.expert_load
    assert pieces.terms.load_balancing == pytest.approx(whole.terms.load_balancing, rel=1e-6)
    if experts.top_k == experts.num_experts:
        assert all(e.max_tokens == e.mean_tokens == inputs for e in whole.expert_load)
        assert whole.terms.load_balancing == pytest.approx(1.0, rel=1e-6)
    else:
        assert 0.5 < whole.terms.load_balancing < experts.num_experts
    print(f"{world}: switch loss {whole.terms.load_balancing:.4f}, load {whole.expert_load}")


def test_two_ranks_route_as_one(worlds):
    one, two = worlds["mixtral-ep1-aux-loss"].metrics[0], worlds["mixtral-ep2-aux-loss"].metrics[0]
    assert two.expert_load == one.expert_load
    assert two.terms.load_balancing == pytest.approx(one.terms.load_balancing, rel=1e-6)


def test_experts_that_do_not_split_over_ep_are_refused_at_start(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path / "model", ModelFamily.QWEN3_MOE, num_layers=2)
    command = [sys.executable, "-m", "trainer_svc", "--port", "0", "--insecure"]
    command += ["--model", str(model_dir), "--dp", "3", "--ep", "3"]
    result = subprocess.run(
        command,
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, **TEST_ENV},
        timeout=300,
    )
    assert result.returncode == 2
    assert "8 experts do not split over expert parallel 3" in result.stderr
    assert "[rank" not in result.stderr


@pytest.mark.slow
def test_replicated_experts_and_the_reference_policy_train_as_one_rank(tmp_path):
    """DP=4 x EP=2 (each expert on two ranks, its gradient summed over both), the service's
    reference policy for the KL term and the load-balancing loss: two steps, then Forward with
    reference logprobs, as on one rank."""
    model_dir = write_tiny_checkpoint(tmp_path / "model", QWEN3_MOE, num_layers=2, seed=5)
    common = ["--model", str(model_dir), "--reference-policy", "initial", *AUX_LOSS]
    four = ["--dp", "4", "--ep", "2", "--pass-token-budget", "30"]
    processes = start_trainers(
        {"one": (tmp_path / "one", common), "dp4-ep2": (tmp_path / "four", [*common, *four])}
    )
    loss = LossConfig(kind=LossKind.PPO, kl_coef=0.1, reference_source=ReferenceSource.SERVICE)
    wanted = [ForwardOutput.LOGPROBS, ForwardOutput.REFERENCE_LOGPROBS]
    runs = {}
    try:
        for name, process in processes.items():
            for step in range(2):
                batch = make_batch(
                    seed=7 + step, lengths=LENGTHS, loss=LossConfig(kind=LossKind.PPO)
                )
                process.client.begin_step(f"s{step}", loss, OPTIMIZER)
                process.client.train_microbatch(f"s{step}", "r", batch)
                process.client.finish_step(f"s{step}")
            runs[name] = (process.export("after"), process.client.forward(batch, wanted))
    finally:
        assert stop_trainers(processes.values()) == [0] * len(processes)
    (one, one_forward), (four_ranks, four_forward) = runs["one"], runs["dp4-ep2"]
    assert max_relative_difference(four_ranks, one) <= 1e-5
    assert np.abs(four_forward.logprobs - one_forward.logprobs).max() <= 1e-5
    gap = np.abs(four_forward.reference_logprobs - one_forward.reference_logprobs).max()
    assert gap <= 1e-5


@pytest.mark.parametrize("world", PUBLISHING)
def test_a_version_publishes_each_layers_experts_grouped_and_equal_to_export(worlds, world):
    """One fc1 [E, 2I, H] and one fc2 [E, H, I] tensor per layer, no per-expert names; each
    EP rank's shard holds its contiguous experts and says which EP rank it is; the bytes
    equal ExportHF's experts."""
    family, experts = WORLDS[world][0], WORLDS[world][1]
    manifest, pulled = worlds[world].published or pytest.fail(f"{world} published nothing")
    exported = worlds[world].pieces
    names = hf_expert_names(family)
    assert not any("local_experts" in n for n in manifest.names)
    width, count = experts.ffn_hidden_size, experts.num_experts
    for layer in range(2):
        prefix = f"model.layers.{layer}.{names.experts}"

        def stacked(projection: str, layer_prefix: str = prefix) -> np.ndarray:
            return np.stack(
                [exported[f"{layer_prefix}.{e}.{projection}.weight"] for e in range(count)]
            )

        fc1, fc2 = grouped_expert_name(layer, 1), grouped_expert_name(layer, 2)
        assert pulled[fc1].shape == (count, 2 * width, 64)
        assert np.array_equal(pulled[fc1][:, :width], stacked(names.gate))
        assert np.array_equal(pulled[fc1][:, width:], stacked(names.up))
        assert np.array_equal(pulled[fc2], stacked(names.down))
        for name in (fc1, fc2):
            record = manifest.get(name)
            assert record is not None
            shards = sorted((s.expert_rank, s.pieces[0].box.ranges[0]) for s in record.shards)
            # EP rank r holds experts [4r, 4r + 4): the two ranks of a stage are EP ranks 0, 1.
            assert shards == [(0, (0, 4)), (1, (4, 8))]
