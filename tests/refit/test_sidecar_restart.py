"""A refit sidecar that dies and comes back: the trainer's publication health goes NOT_SERVING,
a FinishTrainStep that cannot publish is refused with its step left open, and once a sidecar
serves again on the same address the trainer registers anew, publishes the finished step, and a
receiver refits to it bit for bit; a later version replays an earlier plan with the checksums
its lease carries. A lease the sidecar no longer holds when the pull ends fails the refit
closed. A lease asked for ahead (`Receiver.expect`) is taken by the fetch that follows, given
back when not used, and renewed before the pull when it was asked for long before."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inference_ext.receiver import Receiver, RefitError
from inference_ext.refit_options import ReceiverAuth, RefitOptions
from inference_ext.slices import ReceiverLayout
from megatron_hf.convert import hf_names
from megatron_hf.spec import ModelSpec
from tests.support.batches import make_batch
from tests.support.fidelity import train_step
from tests.support.isolation import in_child_process
from tests.support.receiver import assert_exported, refit_with_stats
from tests.support.sidecar import start_sidecar
from tests.support.trainer import TrainerProcess
from trainer_svc.domain import FailedPrecondition, LossConfig, OptimizerOverrides
from trainer_svc.server.publication_health import SERVICE_NAME

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _wait_publication(trainer: TrainerProcess, status: int, timeout: float = 20.0) -> None:
    health = health_pb2_grpc.HealthStub(trainer.channel)
    deadline = time.monotonic() + timeout
    seen = None
    while time.monotonic() < deadline:
        try:
            seen = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME)).status
        except grpc.RpcError as error:
            seen = error.code()
        if seen == status:
            return
        time.sleep(0.1)
    raise AssertionError(f"publication health stayed {seen}, expected {status}")


def _refit(receiver: Receiver, version: int) -> dict[str, torch.Tensor]:
    return refit_with_stats(receiver, version)[0]


def _finish_when_published(trainer: TrainerProcess, step_id: str) -> int:
    """FinishTrainStep, retried as its refusal says, until the trainer reaches the sidecar."""
    deadline = time.monotonic() + 20
    while True:
        try:
            return trainer.client.finish_step(step_id).weights_version
        except FailedPrecondition:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@in_child_process
def test_the_trainer_publishes_again_after_the_sidecar_restarts(tmp_path: Path) -> None:
    sidecar, running = start_sidecar(tmp_path / "sidecar")
    address = running.address
    port = int(address.rpartition(":")[2])
    trainer = TrainerProcess(
        tmp_path / "trainer", ["--tp", "2", *running.trainer_args(), "--refit-slots", "2"]
    )
    spec = ModelSpec.from_pretrained_dir(tmp_path / "trainer" / "builtin-model")
    names = hf_names(spec)
    token = running.token_file()
    options = RefitOptions(
        receiver_id="restart", pull_timeout_s=60, auth=ReceiverAuth(token_file=token)
    )
    receiver = Receiver(
        address, spec, ReceiverLayout(), names, options=options, device=torch.device("cpu")
    )
    try:
        _wait_publication(trainer, SERVING)
        assert train_step(trainer, "s1", seed=1) == 1
        assert_exported(trainer, _refit(receiver, 1), "v1")

        receiver.expect(2)  # its call dies with the sidecar: the refit of 2 leases anew
        sidecar.send_signal(signal.SIGKILL)
        sidecar.wait()
        _wait_publication(trainer, NOT_SERVING)
        loss = LossConfig()
        trainer.client.begin_step("s2", loss, OptimizerOverrides(learning_rate=2e-2))
        trainer.client.train_microbatch("s2", "r", make_batch(seed=2, lengths=[7, 11], loss=loss))
        with pytest.raises(FailedPrecondition, match="cannot publish the new version"):
            trainer.client.finish_step("s2")
        assert trainer.client.status().weights_version == 1

        # The same tokens: the trainer and the receiver keep theirs across the restart.
        sidecar, _ = start_sidecar(tmp_path / "sidecar-again", port=port, tokens=running.tokens)
        assert _finish_when_published(trainer, "s2") == 2
        installed, stats = refit_with_stats(receiver, 2)
        assert not stats.expected
        assert_exported(trainer, installed, "v2")
        _wait_publication(trainer, SERVING)

        # Once the receiver has met both slots, a version (asked for as FinishTrainStep
        # returns, through the lease call that waits for it) replays its slot's plan by
        # manifest key with the checksums the lease carries (no GetManifest), verified.
        assert train_step(trainer, "s3", seed=3) == 3
        _refit(receiver, 3)

        def unused(*_: object) -> None:
            raise AssertionError("a replayed plan verifies with the lease's checksums")

        receiver.client.manifest = unused  # type: ignore[method-assign]
        receiver.client.checksums = unused  # type: ignore[method-assign]
        trainer.client.begin_step("s4", loss, OptimizerOverrides(learning_rate=2e-2))
        trainer.client.train_microbatch("s4", "r", make_batch(seed=4, lengths=[5, 9], loss=loss))
        assert trainer.client.finish_step("s4").weights_version == 4
        installed, stats = refit_with_stats(receiver, 4)
        assert stats.replayed_by_key and stats.verified_shards > 0
        assert_exported(trainer, installed, "v4")

        # A lease that runs out before the pull ends protects nothing: the refit fails closed.
        brief = RefitOptions(
            receiver_id="brief",
            pull_timeout_s=60,
            lease_ttl_s=1e-4,
            auth=ReceiverAuth(token_file=token),
        )
        short = Receiver(
            address, spec, ReceiverLayout(), names, options=brief, device=torch.device("cpu")
        )
        try:
            with pytest.raises(RefitError, match="lease on version 4 ended before its pull"):
                short.fetch(4)
        finally:
            short.close()

        # A pull that takes longer than the lease's time keeps its version: the lease is
        # renewed every third of it while the pull runs (a dead receiver's lapses within it).
        slow_options = RefitOptions(
            receiver_id="slow",
            pull_timeout_s=60,
            lease_ttl_s=0.6,
            auth=ReceiverAuth(token_file=token),
        )
        slow = Receiver(
            address, spec, ReceiverLayout(), names, options=slow_options, device=torch.device("cpu")
        )
        pull = slow.transport.pull

        def late_pull(*args: object, **kwargs: object) -> object:
            time.sleep(1.5)
            return pull(*args, **kwargs)

        slow.transport.pull = late_pull  # type: ignore[method-assign]
        try:
            installed, _ = refit_with_stats(slow, 4)
            assert_exported(trainer, installed, "v4-slow")
        finally:
            slow.close()

        # A follower asks for the next version's lease before the step (`expect`): the lease
        # comes the moment the version is published and the fetch takes it.
        receiver.expect(5)
        assert train_step(trainer, "s5", seed=5) == 5
        installed, stats = refit_with_stats(receiver, 5)
        assert stats.expected
        assert_exported(trainer, installed, "v5")
        # An expected version that is not fetched gives its lease back (the next expect drops
        # it): the trainer's two slots stay free for the versions after it.
        receiver.expect(6)
        assert train_step(trainer, "s6", seed=6) == 6
        with running.client() as client:
            client.wait_visible(6, timeout=30)
        time.sleep(0.2)  # the lease on version 6 is granted and its answer is in
        receiver.expect(7)
        assert train_step(trainer, "s7", seed=7) == 7
        start = time.monotonic()
        assert train_step(trainer, "s8", seed=8) == 8  # into version 6's slot
        assert time.monotonic() - start < 10, "a lease asked ahead and dropped held its slot"
        installed, stats = refit_with_stats(receiver, 8)
        assert not stats.expected  # version 7's lease was dropped by this fetch
        assert_exported(trainer, installed, "v8")

        # A lease asked for long before its version came counts its time from the asking: it
        # is renewed before the pull, which would otherwise fail closed.
        follower_options = RefitOptions(
            receiver_id="follower",
            pull_timeout_s=60,
            lease_ttl_s=0.6,
            auth=ReceiverAuth(token_file=token),
        )
        follower = Receiver(
            address,
            spec,
            ReceiverLayout(),
            names,
            options=follower_options,
            device=torch.device("cpu"),
        )
        try:
            follower.expect(9, wait_s=20)
            time.sleep(1.0)
            assert train_step(trainer, "s9", seed=9) == 9
            installed, stats = refit_with_stats(follower, 9)
            assert stats.expected
            assert_exported(trainer, installed, "v9-follower")
            # Answered, then fetched only after its lease ran out: leased anew.
            follower.expect(10, wait_s=20)
            assert train_step(trainer, "s10", seed=10) == 10
            with running.client() as client:
                client.wait_visible(10, timeout=30)
            time.sleep(1.5)
            installed, stats = refit_with_stats(follower, 10)
            assert not stats.expected
            assert_exported(trainer, installed, "v10-follower")
        finally:
            follower.close()
    finally:
        receiver.close()
        assert trainer.stop() == 0
        sidecar.send_signal(signal.SIGTERM)
        sidecar.wait(timeout=60)
