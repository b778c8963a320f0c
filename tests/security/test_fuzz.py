"""Fuzz: seeded malformed requests against a real trainer-svc (TrainerService) and a real
refit-sidecar (RefitService) it publishes to, without and then with an open step.

Per service and mode, 2,000 cases (`fuzz_cases`) go out as raw bytes, many at once, each with
a deadline. Every answer must carry a code its method documents for that case (never
DEADLINE_EXCEEDED: nothing hangs; never INTERNAL: a malformed request is no fault of the
service), a bounded message in the service's own words (no exception's text), and "request
body is not a valid ..." for a body that does not parse. Afterwards both processes serve,
their state is what it was (GetStatus, a fixed Forward bit for bit, the sidecar's latest
version and its manifest), the open step finishes with the loss and gradient norm of the same
step run before the fuzz, the trainer publishes the version it makes, no log holds a
traceback, and each log has one line, at most, about undecodable bodies (all of this traffic
comes from one client host).
"""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from tests.security.fuzz_cases import (
    TRAINER_SIDE,
    Case,
    CaseStream,
    TrainerContext,
    sidecar_specs,
    trainer_specs,
)
from tests.support.batches import make_batch
from tests.support.damaged_checkpoints import garbled_copies, refused_load, resealed_copies
from tests.support.sidecar import Sidecar, running_sidecar
from tests.support.trainer import TrainerProcess
from trainer_refit.auth import Role
from trainer_refit.errors import MAX_MESSAGE_BYTES
from trainer_refit.v1 import common_pb2
from trainer_refit.v1 import refit_pb2 as rpb
from trainer_refit.v1 import trainer_pb2 as tpb
from trainer_svc.client import StepResult, forward_request, microbatch_request, publications
from trainer_svc.domain import ForwardOutput, LossConfig, LossKind, OptimizerOverrides

SEED = 20261124
CASES = 2000
"""Per service and mode."""
DEADLINE_SECONDS = 30.0
IN_FLIGHT = 16
LOSS = LossConfig(kind=LossKind.PPO, kl_coef=0.05)
OPTIMIZER = OptimizerOverrides(learning_rate=1e-3)
MAX_TOKENS = 256
MAX_LEASE_SECONDS = 600.0
UNDECODABLE = "a body that is not a valid"
EXCEPTION_TEXT = re.compile(r"Traceback|weights_only|\[Errno|\b\w*(Error|Exception)\b")
"""What only an exception's own text would bring into an answer: a class name ("ValueError:",
"KeyError", "RpcError"), a traceback, an OSError's errno, torch's advice on unpickling."""


@dataclass
class World:
    trainer: TrainerProcess
    sidecar: Sidecar
    sidecar_log: Path
    control: StepResult
    """The step the open-step fuzz runs, run once before any fuzz from the same weights."""
    applied: tpb.TrainMicrobatchRequest


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    workdir = tmp_path_factory.mktemp("fuzz")
    sidecar_log = workdir / "sidecar.log"
    with running_sidecar(workdir / "sidecar", log_path=sidecar_log) as sidecar:
        args = ["--max-microbatch-tokens", str(MAX_TOKENS), "--refit-slots", "2"]
        trainer = TrainerProcess(workdir / "trainer", [*args, *sidecar.trainer_args()])
        try:
            client = trainer.client
            base = trainer.workdir / "base"
            client.save_checkpoint(base)
            batch = make_batch(seed=3, lengths=[11, 6, 19], loss=LOSS)
            client.begin_step("control", LOSS, OPTIMIZER)
            client.train_microbatch("control", "r0", batch)
            control = client.finish_step("control")
            client.load_checkpoint(base)
            applied = microbatch_request("fuzzed", "r0", batch)
            yield World(trainer, sidecar, sidecar_log, control, applied)
        finally:
            assert trainer.stop() == 0


@dataclass(frozen=True)
class State:
    status: tpb.GetStatusResponse
    forward: bytes
    latest: rpb.VersionInfo
    manifest: bytes


def _state(world: World) -> State:
    trainer = world.trainer
    with world.sidecar.client() as receiver:
        receiver.wait_visible(trainer.client.status().weights_version)
    status = _settled_status(trainer)
    forward = forward_request(
        make_batch(seed=9, lengths=[5, 17, 8], loss=LossConfig()),
        [ForwardOutput.LOGPROBS, ForwardOutput.TOP_K, ForwardOutput.ENTROPY],
        top_k=4,
    )
    stub = world.sidecar.stub(Role.RECEIVER)
    latest = stub.GetLatestVersion(rpb.GetLatestVersionRequest())
    manifest = stub.GetManifest(rpb.GetManifestRequest(version=latest.version))
    return State(
        status=status,
        forward=trainer.stub.Forward(forward).SerializeToString(),
        latest=latest,
        manifest=manifest.SerializeToString(),
    )


def _settled_status(trainer: TrainerProcess) -> tpb.GetStatusResponse:
    """GetStatus once every publication it lists is READABLE or FAILED (rank 0 books the
    last one a moment after the version is readable)."""
    deadline = time.monotonic() + 30
    while True:
        status = trainer.client.status()
        if all(p.state.settled for p in publications(status)) or time.monotonic() > deadline:
            return status
        time.sleep(0.05)


@dataclass(frozen=True)
class Outcome:
    code: grpc.StatusCode
    details: str
    reply: bytes


def _send(channel: grpc.Channel, case: Case) -> Outcome:
    try:
        if case.streaming:
            call = channel.unary_stream(case.method)(case.body, timeout=DEADLINE_SECONDS)
            try:
                first = next(call)
            finally:
                call.cancel()
            return Outcome(grpc.StatusCode.OK, "", first)
        reply = channel.unary_unary(case.method)(case.body, timeout=DEADLINE_SECONDS)
        return Outcome(grpc.StatusCode.OK, "", reply)
    except grpc.RpcError as error:
        return Outcome(error.code(), error.details() or "", b"")


def _problems(case: Case, outcome: Outcome) -> list[str]:
    where = f"{case.method} ({case.kind}, {len(case.body)} bytes)"
    problems = []
    if outcome.code not in case.allowed:
        allowed = sorted(code.name for code in case.allowed)
        problems.append(f"{where}: {outcome.code.name} not in {allowed}: {outcome.details[:300]}")
    if len(outcome.details.encode()) > MAX_MESSAGE_BYTES:
        problems.append(f"{where}: a {len(outcome.details.encode())}-byte message")
    if EXCEPTION_TEXT.search(outcome.details):
        problems.append(f"{where}: an exception's text in {outcome.details[:300]!r}")
    if case.request is None and not outcome.details.startswith("request body is not a valid"):
        problems.append(f"{where}: undecodable body answered {outcome.details[:300]!r}")
    if outcome.code != grpc.StatusCode.OK:
        return problems
    method = case.method.rsplit("/", 1)[1]
    if (
        method == "TrainMicrobatch"
        and not tpb.TrainMicrobatchResponse.FromString(outcome.reply).duplicate
    ):
        problems.append(f"{where}: a microbatch was applied")
    if method == "AbortTrainStep" and tpb.AbortTrainStepResponse.FromString(outcome.reply).aborted:
        problems.append(f"{where}: a step was aborted")
    return problems


def _fuzz(world: World, open_step: str | None, seed: int) -> None:
    status = world.trainer.client.status()
    context = TrainerContext(
        open_step=open_step,
        applied=world.applied,
        vocab_size=status.model.vocab_size,
        max_tokens=MAX_TOKENS,
        path_root=os.path.realpath(world.trainer.workdir),
    )
    with world.sidecar.client() as receiver:
        latest = receiver.latest_version() or 0
    trainer_cases = CaseStream("trainer_refit.v1.TrainerService", trainer_specs(context), seed)
    sidecar_cases = CaseStream(
        "trainer_refit.v1.RefitService", sidecar_specs(latest, MAX_LEASE_SECONDS), seed + 1
    )
    channels = {role: world.sidecar.channel(role) for role in (Role.TRAINER, Role.RECEIVER)}

    def channel_for(case: Case) -> grpc.Channel:
        if "RefitService" not in case.method:
            return world.trainer.channel
        trainer_side = case.method.rsplit("/", 1)[1] in TRAINER_SIDE
        return channels[Role.TRAINER if trainer_side else Role.RECEIVER]

    cases = [*trainer_cases.cases(CASES), *sidecar_cases.cases(CASES)]
    start = time.monotonic()
    try:
        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            outcomes = list(pool.map(lambda case: _send(channel_for(case), case), cases))
    finally:
        for channel in channels.values():
            channel.close()
    elapsed = time.monotonic() - start
    problems = [p for case, o in zip(cases, outcomes, strict=True) for p in _problems(case, o)]
    summary = (
        f"{len(cases)} cases in {elapsed:.1f} s; trainer {trainer_cases.counts}, "
        f"sidecar {sidecar_cases.counts}"
    )
    assert not problems, f"{len(problems)} problems ({summary}):\n" + "\n".join(problems[:25])
    print(summary)


def _assert_clean_logs(world: World) -> None:
    assert world.trainer.process.poll() is None, world.trainer.log_tail()
    for path in (world.trainer.log_path, world.sidecar_log):
        text = path.read_text(errors="replace")
        assert "Traceback" not in text, f"{path} holds a traceback:\n{text[-4000:]}"
        assert text.count(UNDECODABLE) <= 1, f"{path}: undecodable bodies logged more than once"


def test_fuzz_without_open_step(world: World) -> None:
    before = _state(world)
    assert not before.status.HasField("open_step")
    _fuzz(world, open_step=None, seed=SEED)
    assert _state(world) == before
    _assert_clean_logs(world)


def test_damaged_checkpoints_change_nothing(world: World) -> None:
    """Every file of the fuzz world's checkpoint garbled at a seeded offset, and content
    damaged behind matching checksums: each load is refused in the service's own words, and
    the trainer and the sidecar's latest version are as before."""
    before = _state(world)
    base = world.trainer.workdir / "base"
    scratch = world.trainer.workdir / "damaged"
    copies = {
        **garbled_copies(base, scratch, seed=SEED),
        **resealed_copies(base, scratch, rank=0),
    }
    for path in copies.values():
        refused_load(world.trainer, path)
    assert _state(world) == before
    _assert_clean_logs(world)


def test_concurrent_registrations_of_other_trainers_change_nothing(world: World) -> None:
    """Many callers with the trainer's token register at once, as other trainers pointed at
    this sidecar would: every one is refused while the trainer holds the sidecar."""
    before = _state(world)
    rng = random.Random(SEED + 1)
    requests = [
        rpb.RegisterTrainerRequest(
            layout=common_pb2.ParallelLayout(world_size=size, tensor_parallel=size),
            num_slots=rng.randint(1, 4),
            owner=f"other-{n}",
            generation=rng.getrandbits(48),
        )
        for n, size in enumerate(rng.choices([1, 2, 4], k=24))
    ]
    stub = world.sidecar.stub(Role.TRAINER)

    def register(request: rpb.RegisterTrainerRequest) -> grpc.StatusCode:
        try:
            stub.RegisterTrainer(request, timeout=DEADLINE_SECONDS)
        except grpc.RpcError as error:
            return error.code()
        return grpc.StatusCode.OK

    with ThreadPoolExecutor(8) as pool:
        codes = set(pool.map(register, requests))
    assert codes == {grpc.StatusCode.ALREADY_EXISTS}
    assert _state(world) == before


def test_fuzz_with_open_step(world: World) -> None:
    client = world.trainer.client
    client.begin_step("fuzzed", LOSS, OPTIMIZER)
    assert not world.trainer.stub.TrainMicrobatch(world.applied).duplicate
    before = _state(world)
    assert before.status.open_step.step_id == "fuzzed"
    _fuzz(world, open_step="fuzzed", seed=SEED + 2)
    assert _state(world) == before

    result = client.finish_step("fuzzed")
    assert result.metrics == world.control.metrics
    with world.sidecar.client() as receiver:
        assert receiver.wait_visible(result.weights_version) == result.weights_version
        assert receiver.manifest(result.weights_version).version == result.weights_version
    _assert_clean_logs(world)
