"""Commands that fail, fail on every rank: bad checkpoint and export paths, paths outside the
trainer's path roots, broken or damaged checkpoints and non-finite steps answer a status code
with a reason, change nothing, and the TP=2 world goes on training and answering Forward. A
fault on a rank is answered by its error id alone; a step whose gradient is zero says so; the
world's pad row (on TP rank 0) trains as transformers trains it."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.batches import make_batch
from tests.support.damaged_checkpoints import (
    assert_refusals_change_nothing,
    garbled_copies,
    resealed_copies,
)
from tests.support.parity import hf_embedding_gradients
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


def _log_size(trainer: TrainerProcess) -> int:
    return trainer.log_path.stat().st_size


def _log_since(trainer: TrainerProcess, mark: int) -> str:
    """What every rank logged since `mark` (`_log_size`)."""
    with trainer.log_path.open("rb") as log:
        log.seek(mark)
        return log.read().decode(errors="replace")


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
    assert finished.metrics.gradient == pb.STEP_GRADIENT_NONZERO
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
    # Its size and checksum no longer match those recorded at save.
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


def _scratch(trainer: TrainerProcess, name: str) -> Path:
    """A new directory under the trainer's path root, with `copies/` in it."""
    scratch = trainer.workdir / name
    (scratch / "copies").mkdir(parents=True)
    return scratch


def _away_from_base(trainer: TrainerProcess, step_id: str) -> None:
    """The live state one step past `base`, so that reading any part of base would show."""
    trainer.client.load_checkpoint(trainer.base)
    _step(trainer, step_id, trainer.batch)


def test_a_damaged_checkpoint_is_refused_and_changes_nothing(trainer):
    """Same-size garbage anywhere in any file of a checkpoint, an edited trainer state, a file
    the save did not write, a checkpoint written before checksums: each refused by rank 0's
    check of the checksums recorded at save, before any rank reads, in the service's words."""
    _away_from_base(trainer, "away-from-garbled")
    scratch = _scratch(trainer, "garbled")
    copies = garbled_copies(trainer.base, scratch / "copies", seed=38)
    file_names = {name: name.split(" ")[0] for name in copies}
    edited = shutil.copytree(trainer.base, scratch / "copies" / "edited-state")
    state = json.loads((edited / "trainer_state.json").read_text())
    state["optimizer_step"] += 1
    (edited / "trainer_state.json").write_text(json.dumps(state))
    stray = shutil.copytree(trainer.base, scratch / "copies" / "stray-file")
    (stray / "stray.distcp").write_bytes(b"\0" * 16)
    old = shutil.copytree(trainer.base, scratch / "copies" / "no-checksums")
    del state["files"], state["record_sha256"]
    (old / "trainer_state.json").write_text(json.dumps(state))
    copies |= {"state edited": edited, "stray file": stray, "no checksums": old}

    messages = assert_refusals_change_nothing(
        trainer,
        copies,
        lambda step_id: _step(trainer, step_id, trainer.batch),
        trainer.batch,
        scratch,
    )
    for name, file_name in file_names.items():
        assert file_name in messages[name], (name, messages[name])
    assert "does not match its own checksum" in messages["state edited"]
    assert "stray.distcp" in messages["stray file"]
    assert "older version" in messages["no checksums"], messages["no checksums"]


def test_a_checkpoint_that_fails_while_loading_changes_nothing(trainer):
    """Checksums that match (recorded again after the damage): a stored tensor that only rank
    1 reads cannot be read or is NaN, or a tensor's shape is another. The ranks read into
    staging and agree before any live tensor changes, so the refusal changes nothing."""
    _away_from_base(trainer, "away-from-resealed")
    scratch = _scratch(trainer, "resealed")
    copies = resealed_copies(trainer.base, scratch / "copies")
    messages = assert_refusals_change_nothing(
        trainer,
        copies,
        lambda step_id: _step(trainer, step_id, trainer.batch),
        trainer.batch,
        scratch,
    )
    for name, message in messages.items():
        if "rank 1" in name:
            assert "rank 1" in message, (name, message)


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
    version = client.status().weights_version
    extreme = _extreme(trainer.batch, behaviour=-100.0, advantage=-1.0)
    finished = _step(trainer, "extreme", extreme)
    metrics = finished.metrics
    assert math.isfinite(metrics.loss) and metrics.loss > 1e8
    assert metrics.terms.importance_ratio == pytest.approx(math.exp(20.0), rel=1e-5)
    # No token's ratio carries a gradient: the answer says the step trained nothing, and the
    # version still advances, since the optimizer stepped (trainer.proto, StepGradient).
    assert metrics.gradient == pb.STEP_GRADIENT_ZERO and metrics.grad_norm == 0.0
    assert finished.weights_version == version + 1
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
    mark = _log_size(trainer)
    code, details = _refusal(stub.FinishTrainStep, pb.FinishTrainStepRequest(step_id="huge"))
    assert code == PRECONDITION
    assert "not finite" in details and "gradients" in details, details
    # An expected refusal: one line on each rank, no traceback.
    log = _log_since(trainer, mark)
    assert log.count("was not applied") == 2 and "Traceback" not in log, log

    status = client.status()
    assert status.weights_version == version
    assert status.optimizer_step == 0
    assert not status.HasField("open_step")
    assert client.abort_step("huge") is False
    assert_bit_identical(trainer.export("after-non-finite"), before)
    # The optimizer state is untouched too: the next step is the reference step from base.
    _step(trainer, "after-non-finite", trainer.batch)
    assert_bit_identical(trainer.export("after-non-finite-then-step"), trainer.reference)


def test_a_fault_on_a_rank_is_answered_by_its_error_id_alone(trainer):
    """A rank that fails for a reason that is no refusal (here rank 0's export, whose model
    config no longer parses as one) answers INTERNAL with an error id and nothing of the
    exception's text; the id leads to the traceback in the log, and the world serves on."""
    config = trainer.workdir / "builtin-model" / "config.json"
    original = config.read_text()
    mark = _log_size(trainer)
    config.write_text("[1, 2]")  # JSON, but no object: reading it as a config raises TypeError
    try:
        request = pb.ExportHFRequest(path=str(trainer.workdir / "exports" / "fault"))
        code, details = _refusal(trainer.stub.ExportHF, request)
    finally:
        config.write_text(original)
    assert code == grpc.StatusCode.INTERNAL
    answered = re.fullmatch(r"internal error ([0-9a-f]{12}); see the server log", details)
    assert answered, details
    log = _log_since(trainer, mark)
    assert f"rank 0 failed (error {answered[1]})" in log and log.count("Traceback") == 1, log
    _assert_serving(trainer, "after-fault")


PAD_ROW_TOKENS = [[5, 0, 9, 0, 0, 7, 3, 12, 0, 40], [0, 0, 44, 8, 0, 21, 2, 0, 17, 5]]
"""The built-in model's pad token (0, a row of TP rank 0) looked up and predicted."""


def test_the_pad_row_trains_as_in_transformers(trainer):
    """One cross-entropy step from `base` (Adam's first update moves exactly the weights whose
    gradient is non-zero) changes exactly the embedding and output rows that transformers
    gives a gradient on the same weights and batch: not the pad row of the embedding, which
    its padding_idx freezes, though the pad token is looked up; the pad row of the output."""
    client = trainer.client
    client.load_checkpoint(trainer.base)
    before = trainer.export("before-pad-row")
    batch = SequenceBatch.from_lists(
        PAD_ROW_TOKENS, loss_mask=[[False] + [True] * (len(s) - 1) for s in PAD_ROW_TOKENS]
    )
    client.begin_step("pad-row", LossConfig(), OPTIMIZER)
    client.train_microbatch("pad-row", "r0", batch)
    client.finish_step("pad-row")
    after = trainer.export("after-pad-row")
    expected = hf_embedding_gradients(
        trainer.workdir / "exports" / "before-pad-row", torch.tensor(PAD_ROW_TOKENS)
    )
    changed = {}
    for name, key in (("model.embed_tokens.weight", "embedding"), ("lm_head.weight", "output")):
        changed[key] = np.flatnonzero((after[name] != before[name]).any(axis=1))
        trained = np.flatnonzero(expected[key].ne(0).any(dim=1).numpy())
        np.testing.assert_array_equal(changed[key], trained, err_msg=name)
    assert 0 not in changed["embedding"] and 0 in changed["output"]
