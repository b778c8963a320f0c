"""SaveCheckpoint -> a new service -> LoadCheckpoint restores weights and optimizer state exactly;
ExportHF writes a checkpoint transformers loads, with the trainer's own logprobs.

The services run a Llama with tied embeddings at PP=2 (x DP=2 in the slow run), so the first
also checks Forward against transformers with the embedding on the first stage and its tied
output layer on the last (test_hf_parity's Llama case). The second starts together with the
first and stays untouched until it loads."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_hf.checkpoint import load_hf_state_dict
from megatron_hf.safetensors_file import INDEX_NAME
from megatron_hf.spec import ModelFamily
from megatron_hf.tiny import write_tiny_checkpoint
from tests.support.batches import make_batch
from tests.support.damaged_checkpoints import (
    assert_refusals_change_nothing,
    garbled_copies,
    resealed_copies,
)
from tests.support.parity import assert_equals_transformers, hf_logprobs, parity_forward
from tests.support.trainer import (
    TrainerProcess,
    assert_bit_identical,
    start_trainers,
    stop_trainers,
)
from trainer_svc.domain import ForwardResult, LossConfig, LossKind, OptimizerOverrides

LAYOUTS = {"pp2": ["--pp", "2"], "pp2-dp2": ["--pp", "2", "--dp", "2"]}
LOSS = LossConfig(kind=LossKind.PPO)
OPTIMIZER = OptimizerOverrides(learning_rate=1e-3)


@dataclass(frozen=True)
class Worlds:
    root: Path
    """The path root of both services: the checkpoint lies beside their work dirs."""
    model_dir: Path
    first: TrainerProcess
    second: TrainerProcess
    initial: ForwardResult
    """The first world's `parity_forward`, taken before any step."""


@pytest.fixture(
    scope="module",
    params=[
        # The default run restores the plain optimizer (DP=1) in a new service. The distributed
        # optimizer (DP=2) runs here in the slow run; the default run saves and loads it in
        # test_split_step's TP=2 x DP=2 world, whose steps each start from a load of its
        # checkpoint (Adam state or step counts that a load left live would fail there).
        "pp2",
        pytest.param("pp2-dp2", marks=pytest.mark.slow),
    ],
)
def worlds(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[Worlds]:
    root = tmp_path_factory.mktemp(f"checkpoints-{request.param}")
    model_dir = write_tiny_checkpoint(
        root / "model", ModelFamily.LLAMA, num_layers=2, seed=13, tie_word_embeddings=True
    )
    args = [*LAYOUTS[request.param], "--model", str(model_dir), "--path-root", str(root)]
    processes = start_trainers({"first": (root / "first", args), "second": (root / "second", args)})
    try:
        initial = parity_forward(processes["first"])
        yield Worlds(root, model_dir, processes["first"], processes["second"], initial)
    finally:
        assert stop_trainers(processes.values()) == [0, 0]


def _step(process: TrainerProcess, step_id: str, seed: int) -> None:
    batch = make_batch(seed=seed, lengths=[8, 13, 21, 6], loss=LOSS)
    process.client.begin_step(step_id, LOSS, OPTIMIZER)
    process.client.train_microbatch(step_id, "r", batch)
    process.client.finish_step(step_id)


def test_forward_equals_transformers_with_embeddings_tied_across_stages(worlds):
    assert_equals_transformers(worlds.initial, worlds.model_dir)


def test_checkpoint_round_trip_and_hf_export(worlds):
    first, second, checkpoint = worlds.first, worlds.second, worlds.root / "ckpt"
    _step(first, "s1", seed=1)
    saved = first.client.save_checkpoint(checkpoint)
    assert saved.optimizer_step == 1
    at_save = first.export("at-save")
    _step(first, "s2", seed=2)
    continued = first.export("continued")
    export_dir = first.workdir / "exports" / "continued"
    batch = make_batch(seed=4, lengths=[9, 17, 3], loss=LossConfig())
    trainer_logprobs = first.client.forward(batch).logprobs

    assert second.client.status().optimizer_step == 0
    loaded = second.client.load_checkpoint(checkpoint)
    assert loaded.optimizer_step == 1
    assert second.client.status().optimizer_step == 1
    assert_bit_identical(second.export("loaded"), at_save)
    _step(second, "s2", seed=2)
    assert_bit_identical(second.export("continued"), continued)

    assert np.abs(hf_logprobs(export_dir, batch) - trainer_logprobs).max() <= 1e-4


def test_a_damaged_checkpoint_is_refused_and_changes_nothing(worlds):
    """At PP=2: same-size garbage in any file is refused by the checksums; a tensor that rank 1
    reads, unreadable or NaN, or a shape changed, with checksums that match, by the staged
    load. None changes Forward, the weights or the next step."""
    process = worlds.second
    source = worlds.root / "damage-source"
    process.client.save_checkpoint(source)
    _step(process, "away-from-source", seed=5)
    scratch = worlds.root / "damaged"
    copies = garbled_copies(source, scratch / "copies", seed=38)
    copies |= resealed_copies(source, scratch / "copies")
    batch = make_batch(seed=4, lengths=[9, 17, 3], loss=LossConfig())
    assert_refusals_change_nothing(
        process, copies, lambda step_id: _step(process, step_id, seed=6), batch, scratch
    )


def test_the_default_export_is_a_sharded_bf16_checkpoint_each_stage_writes(worlds):
    """ExportHF's default at PP=2: bf16 weights in several files (none spanning the two stages
    that write them), an index, the config's dtype and tie flag, and transformers loads it with
    no key missing or unexpected; the weights are the trainer's, rounded to bf16."""
    first = worlds.first
    path = first.workdir / "exports" / "bf16"
    reply = first.client.export_hf(path, max_file_bytes=20_000)
    exact = first.export("exact-beside-bf16")
    files = sorted(path.glob("model-*-of-*.safetensors"))
    index = json.loads((path / INDEX_NAME).read_text())
    assert len(files) >= 3 and set(index["weight_map"].values()) == {f.name for f in files}
    assert not list(path.glob("*.partial"))
    exported = load_hf_state_dict(path)
    assert exported.keys() == exact.keys()
    for name, tensor in exported.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, torch.from_numpy(exact[name]).to(torch.bfloat16)), name
    assert reply.num_tensors == len(exported)
    total = sum(t.nbytes for t in exported.values())
    assert reply.num_bytes == index["metadata"]["total_size"] == total
    config = json.loads((path / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    _, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
