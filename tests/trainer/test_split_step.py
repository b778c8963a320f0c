"""A step streamed as k uneven microbatches equals the same data sent as one microbatch,
for every parallel layout, every loss and normalization and a sampler correction (through the
gRPC server)."""

from __future__ import annotations

import pytest

from tests.support.batches import make_batch, split
from tests.support.damaged_checkpoints import assert_refusals_change_nothing, resealed_copies
from tests.support.trainer import TrainerProcess, max_relative_difference
from trainer_svc.domain import (
    Correction,
    CorrectionLevel,
    LossConfig,
    LossKind,
    Normalization,
    OptimizerOverrides,
)

LAYOUTS = {
    "tp2": ["--tp", "2"],
    "pp2": ["--pp", "2"],
    "dp2": ["--dp", "2"],
    "tp2-dp2": ["--tp", "2", "--dp", "2"],
}
LOSSES = {
    "ce-token": LossConfig(kind=LossKind.CROSS_ENTROPY, normalization=Normalization.TOKEN),
    "ce-sequence": LossConfig(kind=LossKind.CROSS_ENTROPY, normalization=Normalization.SEQUENCE),
    "ppo-token": LossConfig(kind=LossKind.PPO, normalization=Normalization.TOKEN, kl_coef=0.1),
    "ppo-sequence": LossConfig(
        kind=LossKind.PPO, normalization=Normalization.SEQUENCE, clip_low=0.1, clip_high=0.3
    ),
    # Sequence-level ratios, a stop-gradient weight, dual clip, an entropy bonus and the
    # constant divisor, each a sum over sequences that a split must not change.
    "gspo-sequence": LossConfig(
        kind=LossKind.GSPO, normalization=Normalization.SEQUENCE, clip_low=0.05, clip_high=0.08
    ),
    "cispo-constant": LossConfig(
        kind=LossKind.CISPO,
        normalization=Normalization.CONSTANT,
        normalization_length=32,
        entropy_coef=0.01,
    ),
    "ppo-dual-clip": LossConfig(kind=LossKind.PPO, dual_clip=2.0, kl_coef=0.1),
    "ppo-tis-sequence": LossConfig(
        kind=LossKind.PPO,
        normalization=Normalization.SEQUENCE,
        correction=Correction.TIS,
        correction_level=CorrectionLevel.SEQUENCE,
    ),
}
LENGTHS = [9, 17, 5, 12, 30, 7, 21]
# Adam's first update is lr * g / (|g| + eps): with the default eps=1e-8, gradients near 1e-8 turn
# float summation-order noise into weight differences. A larger eps keeps the update a smooth
# function of the gradient, so the comparison measures the gradients, not Adam's sign().
OPTIMIZER = OptimizerOverrides(learning_rate=1e-3, adam_eps=1e-4)


@pytest.fixture(
    scope="module",
    params=[
        # TP=2 x DP=2 splits both dimensions at once; each alone runs in the slow run.
        pytest.param(name, marks=pytest.mark.slow) if name in ("tp2", "dp2") else name
        for name in LAYOUTS
    ],
)
def trainer(request, tmp_path_factory):
    workdir = tmp_path_factory.mktemp(f"split-{request.param}")
    process = TrainerProcess(workdir, LAYOUTS[request.param])
    process.layout = request.param
    process.client.save_checkpoint(workdir / "base")
    process.base_weights = process.export("base")
    yield process
    assert process.stop() == 0


def _step(trainer: TrainerProcess, name: str, loss: LossConfig, sizes: list[int]) -> dict:
    trainer.client.load_checkpoint(trainer.workdir / "base")
    batch = make_batch(seed=7, lengths=LENGTHS, loss=loss)
    trainer.client.begin_step(name, loss, OPTIMIZER)
    for i, part in enumerate(split(batch, sizes)):
        trainer.client.train_microbatch(name, f"{name}-{i}", part)
    result = trainer.client.finish_step(name)
    assert result.metrics.counts.microbatches == len(sizes)
    return trainer.export(name)


@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_microbatch_split_gives_the_one_shot_update(trainer, loss_name):
    loss = LOSSES[loss_name]
    one_shot = _step(trainer, f"{loss_name}-whole", loss, [len(LENGTHS)])
    streamed = _step(trainer, f"{loss_name}-split", loss, [1, 4, 2])
    moved = max_relative_difference(one_shot, trainer.base_weights)
    gap = max_relative_difference(streamed, one_shot)
    print(f"{loss_name}: step moved weights by {moved:.2e}, split vs one-shot gap {gap:.2e}")
    assert moved > 1e-3, "the step did not change the weights"
    assert gap <= 1e-5


def test_a_load_refused_while_reading_leaves_the_distributed_optimizer_as_it_was(trainer):
    """With DP, megatron's distributed optimizer holds Adam's state in bucket shards. A load
    that every rank reads and then refuses (a tensor NaN or unreadable, a shape changed; the
    checksums match) leaves it as it was: the next step is bit for bit the step without it."""
    if "dp" not in trainer.layout:
        pytest.skip("the distributed optimizer runs with DP > 1")
    loss = LOSSES["ppo-token"]
    batch = make_batch(seed=7, lengths=LENGTHS, loss=loss)

    def train(step_id: str) -> None:
        trainer.client.begin_step(step_id, loss, OPTIMIZER)
        trainer.client.train_microbatch(step_id, step_id, batch)
        trainer.client.finish_step(step_id)

    trainer.client.load_checkpoint(trainer.workdir / "base")
    train("away-from-base")
    scratch = trainer.workdir / "refused"
    copies = resealed_copies(trainer.workdir / "base", scratch / "copies")
    assert_refusals_change_nothing(trainer, copies, train, batch, scratch)
