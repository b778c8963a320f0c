"""Commands that fail, fail on every rank: bad checkpoint and export paths, paths outside the
trainer's path roots, broken checkpoints and non-finite steps answer a status code with a
reason, change nothing, and the TP=2 world goes on training and answering Forward."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.batches import make_batch
from tests.support.trainer import TrainerProcess, assert_bit_identical
from trainer_refit.v1 import trainer_pb2 as pb
from trainer_svc.domain import LossConfig, LossKind, OptimizerOverrides, SequenceBatch

LOSS = LossConfig(kind=LossKind.PPO)
OPTIMIZER = OptimizerOverrides(learning_rate=1e-3, weight_decay=0.0)
INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
DENIED = grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("failures")
    process = TrainerProcess(workdir, ["--tp", "2"])
    process.base = workdir / "base"
    process.client.save_checkpoint(process.base)
    process.batch = make_batch(seed=3, lengths=[11, 6, 19], loss=LOSS)
    process.client.load_checkpoint(process.base)
    _step(process, "reference", process.batch)
    process.reference = process.export("reference")
    yield process
    assert process.stop() == 0


def _step(
    trainer: TrainerProcess, step_id: str, batch: SequenceBatch
) -> pb.FinishTrainStepResponse:
    trainer.client.begin_step(step_id, LOSS, OPTIMIZER)
    trainer.client.train_microbatch(step_id, "r0", batch)
    return trainer.stub.FinishTrainStep(pb.FinishTrainStepRequest(step_id=step_id))


def _refusal(call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(request)
    details = info.value.details() or ""
    assert details, "a refusal must say why"
    assert not re.search(r"\b\w+(Error|Exception)\b", details), details
    return info.value.code(), details


def _assert_serving(trainer: TrainerProcess, step_id: str) -> None:
    health = health_pb2_grpc.HealthStub(trainer.channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    version = trainer.client.status().weights_version
    finished = _step(trainer, step_id, trainer.batch)
    assert finished.weights_version == version + 1
    assert math.isfinite(finished.metrics.loss) and math.isfinite(finished.metrics.grad_norm)
    logprobs = trainer.client.forward(trainer.batch).logprobs
    assert logprobs is not None and np.isfinite(logprobs).all()


def _broken_checkpoints(trainer: TrainerProcess, root: Path) -> dict[str, Path]:
    """Directories LoadCheckpoint must refuse, each next to the complete checkpoint `base`."""
    root.mkdir()
    state_file = trainer.base / "trainer_state.json"
    only_state = root / "only-state"
    only_state.mkdir()
    shutil.copy(state_file, only_state)
    not_json = shutil.copytree(trainer.base, root / "not-json")
    (not_json / "trainer_state.json").write_text("{not json")
    no_fields = shutil.copytree(trainer.base, root / "no-fields")
    (no_fields / "trainer_state.json").write_text("[1, 2]")
    truncated = shutil.copytree(trainer.base, root / "truncated")
    shard = max(truncated.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:100])
    no_common = shutil.copytree(trainer.base, root / "no-common-state")
    (no_common / "common.pt").unlink()
    # Passes every check rank 0 makes; every rank then fails to read it, before reading a
    # tensor, and the ranks agree on the failure.
    bad_common = shutil.copytree(trainer.base, root / "corrupt-common-state")
    (bad_common / "common.pt").write_bytes(b"not a torch archive")
    return {
        "only trainer_state.json": only_state,
        "trainer_state.json not JSON": not_json,
        "trainer_state.json not an object": no_fields,
        "truncated shard": truncated,
        "common state missing": no_common,
        "common state corrupt": bad_common,
    }


def test_bad_paths_and_broken_checkpoints_fail_on_every_rank(trainer):
    client, stub = trainer.client, trainer.stub
    client.load_checkpoint(trainer.base)
    before = trainer.export("before-bad-paths")
    status = client.status()
    scratch = trainer.workdir / "bad-paths"  # inside the path root (the work dir)
    scratch.mkdir()
    a_file = scratch / "a-file"
    a_file.write_text("")
    bad_paths = {
        str(scratch / "nul\0byte"): INVALID,
        str(a_file / "ckpt"): PRECONDITION,
        "bad-paths/a-file/ckpt": PRECONDITION,  # relative: under the work dir
        str(a_file): PRECONDITION,
        str(trainer.base): PRECONDITION,
    }
    for path, code in bad_paths.items():
        save = _refusal(stub.SaveCheckpoint, pb.SaveCheckpointRequest(path=path))
        assert save[0] == code, (path, save)
        export = _refusal(stub.ExportHF, pb.ExportHFRequest(path=path))
        assert export[0] == code, (path, export)
    assert _refusal(stub.LoadCheckpoint, pb.LoadCheckpointRequest(path="/x\0y"))[0] == INVALID
    for name, path in _broken_checkpoints(trainer, scratch / "broken").items():
        code, details = _refusal(stub.LoadCheckpoint, pb.LoadCheckpointRequest(path=str(path)))
        assert code == PRECONDITION, (name, details)
        assert str(path) in details, (name, details)

    after = client.status()
    assert (after.weights_version, after.optimizer_step) == (
        status.weights_version,
        status.optimizer_step,
    )
    assert_bit_identical(trainer.export("after-bad-paths"), before)
    _assert_serving(trainer, "after-bad-paths")


def test_paths_outside_the_path_roots_are_refused(trainer, tmp_path):
    """The trainer's only path root is its work dir: anything that leads elsewhere, even to a
    complete checkpoint, is refused before any rank acts, and the world trains on."""
    client, stub = trainer.client, trainer.stub
    client.load_checkpoint(trainer.base)
    status = client.status()
    root = trainer.workdir.resolve()
    outside = tmp_path.resolve()
    shutil.copytree(trainer.base, outside / "copied-base")
    (root / "escape").symlink_to(outside)  # planted inside the root, leads out
    look_alike = Path(f"{root}-evil")
    look_alike.mkdir()
    refused = [
        outside / "ckpt",
        root / "escape" / "ckpt",
        look_alike / "ckpt",
        root / ".." / "ckpt",
        Path("../ckpt"),
        Path("/dev/null/ckpt"),
    ]
    for path in refused:
        for call, request in (
            (stub.SaveCheckpoint, pb.SaveCheckpointRequest(path=str(path))),
            (stub.ExportHF, pb.ExportHFRequest(path=str(path))),
        ):
            code, details = _refusal(call, request)
            assert code == DENIED, (path, details)
            assert str(path) in details and str(root) in details, details
    for path in (outside / "copied-base", root / "escape" / "copied-base"):
        code, details = _refusal(stub.LoadCheckpoint, pb.LoadCheckpointRequest(path=str(path)))
        assert code == DENIED, (path, details)
    assert sorted(p.name for p in outside.iterdir()) == ["copied-base"]
    assert not any(look_alike.iterdir())

    after = client.status()
    assert (after.weights_version, after.optimizer_step) == (
        status.weights_version,
        status.optimizer_step,
    )
    _assert_serving(trainer, "after-outside-paths")
    # A relative path is under the root, and the reply names where it went.
    saved = client.save_checkpoint("saved-by-relative-path")
    assert saved.path == root / "saved-by-relative-path"
    assert (saved.path / "trainer_state.json").is_file()


def _extreme(batch: SequenceBatch, *, behaviour: float, advantage: float) -> SequenceBatch:
    assert batch.behaviour_logprobs is not None and batch.advantages is not None
    return SequenceBatch(
        tokens=batch.tokens,
        offsets=batch.offsets,
        loss_mask=batch.loss_mask,
        advantages=np.full_like(batch.advantages, advantage),
        behaviour_logprobs=np.full_like(batch.behaviour_logprobs, behaviour),
    )


def test_extreme_importance_ratios_give_a_finite_clipped_step(trainer):
    # Valid input: every policy logprob is ~e^95 times its behaviour probability.
    client = trainer.client
    client.load_checkpoint(trainer.base)
    before = client.forward(trainer.batch).logprobs
    extreme = _extreme(trainer.batch, behaviour=-100.0, advantage=-1.0)
    finished = _step(trainer, "extreme", extreme)
    metrics = finished.metrics
    assert math.isfinite(metrics.loss) and metrics.loss > 1e8
    assert math.isfinite(metrics.grad_norm)
    assert metrics.terms.importance_ratio == pytest.approx(math.exp(20.0), rel=1e-5)
    after = client.forward(trainer.batch).logprobs
    # Every ratio is past the clamp, so no gradient: Adam's first update is exactly zero.
    assert after is not None and np.isfinite(after).all()
    np.testing.assert_array_equal(after, before)
    _assert_serving(trainer, "after-extreme")


def test_a_step_with_non_finite_gradients_is_refused_and_changes_nothing(trainer):
    client, stub = trainer.client, trainer.stub
    client.load_checkpoint(trainer.base)
    before = trainer.export("before-non-finite")
    version = client.status().weights_version
    # A finite advantage near float32's largest value on one token: the loss stays finite,
    # its backward overflows.
    assert trainer.batch.advantages is not None
    advantages = trainer.batch.advantages.copy()
    advantages[5] = 1e38
    huge = SequenceBatch(
        tokens=trainer.batch.tokens,
        offsets=trainer.batch.offsets,
        loss_mask=trainer.batch.loss_mask,
        advantages=advantages,
        behaviour_logprobs=trainer.batch.behaviour_logprobs,
    )
    client.begin_step("huge", LOSS, OPTIMIZER)
    client.train_microbatch("huge", "r0", huge)
    code, details = _refusal(stub.FinishTrainStep, pb.FinishTrainStepRequest(step_id="huge"))
    assert code == PRECONDITION
    assert "not finite" in details and "gradients" in details, details

    status = client.status()
    assert status.weights_version == version
    assert status.optimizer_step == 0
    assert not status.HasField("open_step")
    assert client.abort_step("huge") is False
    assert_bit_identical(trainer.export("after-non-finite"), before)
    # The optimizer state is untouched too: the next step is the reference step from base.
    _step(trainer, "after-non-finite", trainer.batch)
    assert_bit_identical(trainer.export("after-non-finite-then-step"), trainer.reference)
