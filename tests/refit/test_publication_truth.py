"""What FinishTrainStep and GetStatus say of a version's publication is true, through a refit
sidecar killed and restarted at every point of a step and through a second trainer registering
with the trainer's token.

One TP=2 trainer, one receiver and one sidecar address serve both parts:

- Restarts (seeded): the sidecar dies before a step begins, between its microbatch and its
  finish, right after the finish is answered, or once its version is readable. Every version
  the trainer made settles READABLE or FAILED in GetStatus; one answered READABLE was readable;
  one FAILED never is; every readable version the receiver pulls equals the trainer's export of
  that version bit for bit (no half version is served); the receiver ends on the newest.
- A rival registration: refused while the trainer lives (also many at once), and once it takes
  over, the trainer's ranks cannot complete any version of the new registration, the trainer's
  publication health says so and its next FinishTrainStep is refused naming the rival.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2

from inference_ext.receiver import Receiver
from inference_ext.refit_options import ReceiverAuth, RefitError, RefitOptions, RefitStats
from inference_ext.slices import ReceiverLayout
from megatron_hf.convert import hf_names
from megatron_hf.spec import ModelSpec
from refit_sidecar.service.client import RegistrationHeld, TrainerLayout, UnknownVersion
from tests.refit.test_sidecar_restart import _wait_publication
from tests.support.batches import make_batch
from tests.support.isolation import in_child_process
from tests.support.receiver import refit_with_stats
from tests.support.sidecar import Sidecar, start_sidecar
from tests.support.trainer import TrainerProcess
from trainer_refit.auth import Role
from trainer_svc.client import StepResult, publications
from trainer_svc.domain import (
    FailedPrecondition,
    LossConfig,
    OptimizerOverrides,
    Publication,
    PublicationState,
)

POINTS = ("before_begin", "before_finish", "after_finish", "after_readable")
RESTARTS = 10
LOSS = LossConfig()
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class RestartingSidecar:
    """A sidecar process on a fixed port, killed and started again with the same tokens."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.life = 0
        self.process, self.sidecar = start_sidecar(workdir / "life-0", log_path=self._log(0))
        self.port = int(self.sidecar.address.rpartition(":")[2])

    def _log(self, life: int) -> Path:
        self.workdir.mkdir(parents=True, exist_ok=True)
        return self.workdir / f"life-{life}.log"

    def served(self, version: int, life: int) -> bool:
        """Whether `version` became readable during sidecar life `life` (by its own log)."""
        return f"version {version} is readable" in self._log(life).read_text()

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def start(self) -> None:
        self.life += 1
        self.process, _ = start_sidecar(
            self.workdir / f"life-{self.life}",
            port=self.port,
            tokens=self.sidecar.tokens,
            log_path=self._log(self.life),
        )

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(timeout=60) == 0


def _finish(trainer: TrainerProcess, step_id: str, *, wait: bool) -> StepResult:
    """FinishTrainStep, retried as its refusal says while the sidecar is away (the step stays
    open)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return trainer.client.finish_step(step_id, wait_for_publication=wait)
        except FailedPrecondition as refusal:
            assert "cannot publish the new version" in str(refusal)
            assert time.monotonic() < deadline, "the trainer never published again"
            time.sleep(0.2)


def _settled(trainer: TrainerProcess, version: int) -> Publication:
    """`version`'s publication in GetStatus once it is READABLE or FAILED."""
    deadline = time.monotonic() + 60
    while True:
        found = {p.weights_version: p for p in publications(trainer.client.status())}
        entry = found.get(version)
        assert entry is not None, f"GetStatus forgot version {version}: {found}"
        if entry.state.settled:
            return entry
        assert time.monotonic() < deadline, f"version {version} stayed {entry}"
        time.sleep(0.1)


def _assert_pulled(receiver: Receiver, version: int, exported: dict[str, np.ndarray]) -> None:
    installed, _ = _refit_after_restart(receiver, version)
    assert set(installed) == set(exported)
    for name, tensor in installed.items():
        assert torch.equal(tensor, torch.from_numpy(exported[name])), (version, name)


def _refit_after_restart(
    receiver: Receiver, version: int
) -> tuple[dict[str, torch.Tensor], RefitStats]:
    """A refit soon after the sidecar came back: the receiver's channel may still wait out its
    reconnect backoff from the sidecar's absence (about a second), failing a lease at once
    with UNAVAILABLE, and such a refit changes nothing; the next attempt reaches the sidecar."""
    for attempt in range(5):
        try:
            return refit_with_stats(receiver, version)
        except RefitError as e:
            unavailable = isinstance(e.__cause__, grpc.RpcError) and (
                e.__cause__.code() is grpc.StatusCode.UNAVAILABLE
            )
            if not unavailable or attempt == 4:
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")


def _restarts(trainer: TrainerProcess, sidecar: RestartingSidecar, receiver: Receiver) -> None:
    rng = random.Random(38)
    points = [POINTS[i % len(POINTS)] for i in range(RESTARTS)]
    rng.shuffle(points)
    readable_in_life: dict[int, int] = {}
    """Versions settled READABLE, with the sidecar life they were readable in."""
    for i, point in enumerate(points):
        step_id = f"restart-{i}"
        if point == "before_begin":
            sidecar.kill()
            time.sleep(rng.uniform(0.0, 1.5))
            sidecar.start()
        trainer.client.begin_step(step_id, LOSS, OptimizerOverrides(learning_rate=2e-2))
        trainer.client.train_microbatch(
            step_id, "r", make_batch(seed=i, lengths=[9, 14], loss=LOSS)
        )
        back: threading.Timer | None = None
        if point == "before_finish":
            sidecar.kill()
            # The finish meets the sidecar away (and is refused until it is back), or just back.
            back = threading.Timer(rng.uniform(0.0, 1.5), sidecar.start)
            back.start()
        waited = rng.random() < 0.5
        result = _finish(trainer, step_id, wait=waited)
        if back is not None:
            back.join()
        finished_in = sidecar.life
        if point == "after_finish":
            sidecar.kill()
            time.sleep(rng.uniform(0.0, 0.5))
            sidecar.start()
        version = result.weights_version
        assert result.publication is not None and result.publication.weights_version == version
        if waited:
            assert result.publication.state.settled, result.publication
        settled = _settled(trainer, version)
        assert settled.state in (PublicationState.READABLE, PublicationState.FAILED), settled
        if result.publication.state is PublicationState.READABLE:
            assert settled.state is PublicationState.READABLE  # an answer never takes it back
        exported = trainer.export(f"v{version}")
        if settled.state is PublicationState.FAILED:
            assert settled.reason, settled
            with sidecar.sidecar.client() as client, pytest.raises(UnknownVersion):
                client.manifest(version)  # never readable
            continue
        if finished_in != sidecar.life and sidecar.served(version, finished_in):
            # Readable before the kill that followed the answer: gone with that life, as
            # every version a sidecar served; the trainer's answer stays true of it.
            readable_in_life[version] = finished_in
            continue
        readable_in_life[version] = sidecar.life
        if point == "after_readable":
            sidecar.kill()
            sidecar.start()
        else:
            _assert_pulled(receiver, version, exported)
    outcomes = [p.state for p in publications(trainer.client.status())]
    assert PublicationState.READABLE in outcomes
    assert readable_in_life, "no version was readable through the restarts"

    # Once the sidecar stays, the next version is readable and the receiver ends on it.
    trainer.client.begin_step("settle", LOSS, OptimizerOverrides(learning_rate=2e-2))
    trainer.client.train_microbatch("settle", "r", make_batch(seed=99, lengths=[8], loss=LOSS))
    last = _finish(trainer, "settle", wait=True)
    assert last.publication is not None
    assert last.publication.state is PublicationState.READABLE, last.publication
    with sidecar.sidecar.client() as client:
        assert client.latest_version() == last.weights_version
    _assert_pulled(receiver, last.weights_version, trainer.export("last"))


def _rival(trainer: TrainerProcess, sidecar: Sidecar, receiver: Receiver) -> None:
    layout = TrainerLayout()  # a world of one rank: half of every TP-split tensor
    with sidecar.client(Role.TRAINER, timeout=30) as rival:
        with pytest.raises(RegistrationHeld, match="registered to trainer"):
            rival.register_trainer(layout, 1, owner="rival")

        def register(n: int) -> str:
            with sidecar.client(Role.TRAINER, timeout=30) as client:
                try:
                    client.register_trainer(layout, 1, owner=f"rival-{n}")
                except RegistrationHeld:
                    return "refused"
                return "registered"

        with ThreadPoolExecutor(8) as pool:
            assert set(pool.map(register, range(16))) == {"refused"}
        # Nothing changed: the trainer still publishes.
        trainer.client.begin_step("kept", LOSS, OptimizerOverrides(learning_rate=2e-2))
        trainer.client.train_microbatch("kept", "r", make_batch(seed=7, lengths=[8], loss=LOSS))
        kept = _finish(trainer, "kept", wait=True)
        assert kept.publication is not None
        assert kept.publication.state is PublicationState.READABLE
        _assert_pulled(receiver, kept.weights_version, trainer.export("kept"))

        _wait_publication(trainer, SERVING)  # the restarts' trouble is over
        rival.register_trainer(layout, 1, owner="rival", take_over=True)
        _wait_publication(trainer, NOT_SERVING)  # its heartbeat was refused
        trainer.client.begin_step("fenced", LOSS, OptimizerOverrides(learning_rate=2e-2))
        trainer.client.train_microbatch("fenced", "r", make_batch(seed=8, lengths=[8], loss=LOSS))
        with pytest.raises(FailedPrecondition, match="registered to trainer 'rival'"):
            trainer.client.finish_step("fenced")
        assert trainer.client.status().weights_version == kept.weights_version
        trainer.client.abort_step("fenced")
        with sidecar.client() as client:
            assert client.latest_version() is None  # nothing of the trainer's is readable
        assert rival.reserve_slot(1) == (0, None)
        with sidecar.client() as client:
            assert client.latest_version() is None


@in_child_process
def test_publication_answers_hold_through_restarts_and_a_rival_registration(
    tmp_path: Path,
) -> None:
    sidecar = RestartingSidecar(tmp_path / "sidecar")
    trainer = TrainerProcess(
        tmp_path / "trainer",
        [
            "--tp",
            "2",
            *sidecar.sidecar.trainer_args(),
            "--refit-slots",
            "2",
            "--refit-report-deadline-seconds",
            "10",
        ],
    )
    spec = ModelSpec.from_pretrained_dir(tmp_path / "trainer" / "builtin-model")
    options = RefitOptions(
        receiver_id="follower",
        pull_timeout_s=60,
        auth=ReceiverAuth(token_file=sidecar.sidecar.token_file()),
    )
    receiver = Receiver(
        sidecar.sidecar.address,
        spec,
        ReceiverLayout(),
        hf_names(spec),
        options=options,
        device=torch.device("cpu"),
    )
    try:
        _restarts(trainer, sidecar, receiver)
        _rival(trainer, sidecar.sidecar, receiver)
    finally:
        receiver.close()
        assert trainer.stop() == 0
        sidecar.stop()
