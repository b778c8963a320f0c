"""SaveCheckpoint -> a new service -> LoadCheckpoint restores weights and optimizer state exactly;
ExportHF writes a checkpoint transformers loads, with the trainer's own logprobs."""

from __future__ import annotations

import numpy as np

from tests.support.batches import make_batch
from tests.support.trainer import TrainerProcess, assert_bit_identical
from tests.trainer.test_hf_parity import hf_logprobs
from trainer_svc.domain import LossConfig, LossKind, OptimizerOverrides

LAYOUT = ["--pp", "2", "--dp", "2"]
LOSS = LossConfig(kind=LossKind.PPO)
OPTIMIZER = OptimizerOverrides(learning_rate=1e-3)


def _step(process: TrainerProcess, step_id: str, seed: int) -> None:
    batch = make_batch(seed=seed, lengths=[8, 13, 21, 6], loss=LOSS)
    process.client.begin_step(step_id, LOSS, OPTIMIZER)
    process.client.train_microbatch(step_id, "r", batch)
    process.client.finish_step(step_id)


def test_checkpoint_round_trip_and_hf_export(tmp_path):
    # Both services may use tmp_path: the checkpoint lies beside their work dirs.
    roots = ["--path-root", str(tmp_path)]
    first = TrainerProcess(tmp_path / "first", [*LAYOUT, *roots])
    try:
        _step(first, "s1", seed=1)
        saved = first.client.save_checkpoint(tmp_path / "ckpt")
        assert saved.optimizer_step == 1
        at_save = first.export("at-save")
        _step(first, "s2", seed=2)
        continued = first.export("continued")
        export_dir = first.workdir / "exports" / "continued"
        batch = make_batch(seed=4, lengths=[9, 17, 3], loss=LossConfig())
        trainer_logprobs = first.client.forward(batch).logprobs
    finally:
        assert first.stop() == 0

    second = TrainerProcess(tmp_path / "second", [*LAYOUT, *roots])
    try:
        loaded = second.client.load_checkpoint(tmp_path / "ckpt")
        assert loaded.optimizer_step == 1
        assert second.client.status().optimizer_step == 1
        assert_bit_identical(second.export("loaded"), at_save)
        _step(second, "s2", seed=2)
        assert_bit_identical(second.export("continued"), continued)
    finally:
        assert second.stop() == 0

    assert np.abs(hf_logprobs(export_dir, batch) - trainer_logprobs).max() <= 1e-4
