"""Authentication and authorization on one real stack: a trainer (TP=1, bearer tokens)
publishing to a refit sidecar that requires tokens and mutual TLS.

For every RPC of both services: no token and an unknown token are UNAUTHENTICATED, a valid
token of a role the method does not allow is PERMISSION_DENIED, and afterwards nothing has
changed (the trainer's status and open step, no file written, the sidecar's latest version,
a receiver's lease). Also: a replaced token file is honoured without a restart, a receiver
cannot renew or release another receiver's lease, health answers without a token, and the
sidecar refuses a client without a certificate."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from refit_sidecar.service.access import SERVICE as REFIT_SERVICE
from refit_sidecar.service.client import Lease, SidecarClient, UnknownLease
from tests.support.auth import TlsFiles, Tokens
from tests.support.batches import make_batch
from tests.support.sidecar import Sidecar, running_sidecar
from tests.support.trainer import TrainerProcess
from trainer_refit.auth import ClientAuth, Role, open_channel, write_token_dir
from trainer_refit.v1 import common_pb2, refit_pb2_grpc, trainer_pb2_grpc
from trainer_refit.v1 import refit_pb2 as rpb
from trainer_refit.v1 import trainer_pb2 as tpb
from trainer_svc.client import microbatch_request
from trainer_svc.domain import LossConfig, OptimizerOverrides
from trainer_svc.server.access import SERVICE as TRAINER_SERVICE

LOSS = LossConfig()
BATCH = make_batch(seed=5, lengths=[7, 9], loss=LOSS)


@dataclass
class Stack:
    trainer: TrainerProcess
    sidecar: Sidecar
    workdir: Path
    stranger: Path
    """A token directory of the same shape whose tokens neither service knows."""
    lease: Lease
    """Held by receiver "holder" on version 1 for the whole module."""
    holder: SidecarClient

    def baseline(self) -> tuple[Any, ...]:
        status = self.trainer.client.status()
        renewed = self.holder.renew_lease(self.lease, ttl=600)
        files = sorted(p.name for p in self.workdir.glob("intruder*"))
        return (
            status.weights_version,
            status.optimizer_step,
            status.open_step,
            self.holder.latest_version(),
            renewed.version,
            files,
        )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from tests.support.certs import make_tls_files

    workdir = tmp_path_factory.mktemp("auth-stack")
    tls: TlsFiles = make_tls_files(workdir / "tls")
    with running_sidecar(workdir / "sidecar", tls=tls) as sidecar:
        trainer = TrainerProcess(
            workdir / "trainer", [*sidecar.trainer_args(), "--refit-slots", "2"]
        )
        holder = sidecar.client(Role.RECEIVER, timeout=30)
        try:
            trainer.client.begin_step("s1", LOSS, OptimizerOverrides(learning_rate=1e-3))
            trainer.client.train_microbatch("s1", "m0", BATCH)
            assert trainer.client.finish_step("s1").weights_version == 1
            assert holder.wait_visible(1) == 1  # published over mutual TLS, trainer token
            lease = holder.acquire_lease(1, "holder", ttl=600)
            trainer.client.begin_step("open", LOSS)
            trainer.client.train_microbatch("open", "m0", BATCH)
            stranger = write_token_dir(workdir / "stranger")
            yield Stack(trainer, sidecar, workdir, stranger, lease, holder)
        finally:
            holder.close()
            assert trainer.stop() == 0


# -- every RPC, refused -----------------------------------------------------------------------

Request = Callable[[Stack], Any]

TRAINER_REQUESTS: dict[str, Request] = {
    "BeginTrainStep": lambda s: tpb.BeginTrainStepRequest(step_id="intruder"),
    "TrainMicrobatch": lambda s: microbatch_request("open", "intruder", BATCH),
    "FinishTrainStep": lambda s: tpb.FinishTrainStepRequest(step_id="open"),
    "AbortTrainStep": lambda s: tpb.AbortTrainStepRequest(step_id="open"),
    "Forward": lambda s: tpb.ForwardRequest(
        sequences=tpb.Sequences(tokens=[1, 2, 3], offsets=[0, 3])
    ),
    "SaveCheckpoint": lambda s: tpb.SaveCheckpointRequest(path=str(s.workdir / "intruder-ckpt")),
    "LoadCheckpoint": lambda s: tpb.LoadCheckpointRequest(path=str(s.workdir / "intruder-ckpt")),
    "ExportHF": lambda s: tpb.ExportHFRequest(path=str(s.workdir / "intruder-export")),
    "GetStatus": lambda s: tpb.GetStatusRequest(),
    "SetReference": lambda s: tpb.SetReferenceRequest(),
}


def _shard() -> rpb.ParameterRecord:
    return rpb.ParameterRecord(
        name="w",
        shape=[4],
        dtype=common_pb2.DTYPE_FLOAT32,
        shards=[
            rpb.ShardRecord(
                location=rpb.ShardLocation(agent="intruder", address=4096, nbytes=16),
                pieces=[rpb.ShardPiece(box=rpb.Box(start=[0], stop=[4]))],
            )
        ],
    )


SIDECAR_REQUESTS: dict[str, Request] = {
    "RegisterTrainer": lambda s: rpb.RegisterTrainerRequest(
        layout=common_pb2.ParallelLayout(world_size=1, tensor_parallel=1), num_slots=2
    ),
    "RenewRegistration": lambda s: rpb.RenewRegistrationRequest(generation=1),
    "ReserveSlot": lambda s: rpb.ReserveSlotRequest(version=2),
    "PublishShards": lambda s: rpb.PublishShardsRequest(
        version=2, rank=0, agent=rpb.SourceAgent(name="intruder"), parameters=[_shard()]
    ),
    "GetLatestVersion": lambda s: rpb.GetLatestVersionRequest(),
    "WatchVersions": lambda s: rpb.WatchVersionsRequest(after_version=0),
    "GetManifest": lambda s: rpb.GetManifestRequest(version=1),
    "GetChecksums": lambda s: rpb.GetChecksumsRequest(version=1),
    "AcquireLease": lambda s: rpb.AcquireLeaseRequest(
        version=1, receiver_id="intruder", ttl_seconds=600
    ),
    "RenewLease": lambda s: rpb.RenewLeaseRequest(
        lease_id=s.lease.lease_id, receiver_id="holder", ttl_seconds=0.001
    ),
    "ReleaseLease": lambda s: rpb.ReleaseLeaseRequest(
        lease_id=s.lease.lease_id, receiver_id="holder"
    ),
    "GetSources": lambda s: rpb.GetSourcesRequest(
        version=1,
        receiver_id="intruder",
        wants=[rpb.WantedBox(name="w", box=rpb.Box(start=[0], stop=[4]))],
    ),
    "ReleaseSources": lambda s: rpb.ReleaseSourcesRequest(
        version=1, receiver_id="intruder", complete=False
    ),
    "ListTree": lambda s: rpb.ListTreeRequest(version=1),
}

SERVICES = {
    TRAINER_SERVICE.name: (TRAINER_SERVICE, TRAINER_REQUESTS),
    REFIT_SERVICE.name: (REFIT_SERVICE, SIDECAR_REQUESTS),
}
WRONG_ROLE = {
    TRAINER_SERVICE.name: lambda method: Role.RECEIVER,
    REFIT_SERVICE.name: lambda method: (
        Role.RECEIVER
        if method in ("RegisterTrainer", "RenewRegistration", "ReserveSlot", "PublishShards")
        else Role.TRAINER
    ),
}
CASES = [
    (service, method, credential)
    for service, (_, requests) in SERVICES.items()
    for method in requests
    for credential in ("no-token", "unknown-token", "wrong-role")
]
EXPECTED = {
    "no-token": grpc.StatusCode.UNAUTHENTICATED,
    "unknown-token": grpc.StatusCode.UNAUTHENTICATED,
    "wrong-role": grpc.StatusCode.PERMISSION_DENIED,
}


def test_the_refusal_cases_cover_every_rpc_of_both_services() -> None:
    for service, requests in SERVICES.values():
        assert set(requests) == {m.name for m in service.methods}


def _auth(stack: Stack, service: str, method: str, credential: str) -> ClientAuth:
    token = {
        "no-token": None,
        "unknown-token": stack.stranger / Role.ORCHESTRATOR.value,
        "wrong-role": None,
    }[credential]
    tokens: Tokens = stack.trainer.tokens
    if service == REFIT_SERVICE.name:
        tokens = stack.sidecar.tokens
    if credential == "wrong-role":
        token = tokens.file(WRONG_ROLE[service](method))
    tls = stack.sidecar.tls if service == REFIT_SERVICE.name else None
    return ClientAuth(
        token_file=token,
        insecure=token is None,
        tls_ca=tls.ca if tls else None,
        tls_cert=tls.client_cert if tls else None,
        tls_key=tls.client_key if tls else None,
    )


@pytest.mark.parametrize(("service", "method", "credential"), CASES, ids=map("-".join, CASES))
def test_a_refused_call_changes_nothing(
    stack: Stack, service: str, method: str, credential: str
) -> None:
    before = stack.baseline()
    target = stack.trainer.target if service == TRAINER_SERVICE.name else stack.sidecar.address
    stub_class = (
        trainer_pb2_grpc.TrainerServiceStub
        if service == TRAINER_SERVICE.name
        else refit_pb2_grpc.RefitServiceStub
    )
    request = SERVICES[service][1][method](stack)
    with open_channel(target, _auth(stack, service, method, credential)) as channel:
        call = getattr(stub_class(channel), method)
        with pytest.raises(grpc.RpcError) as info:
            reply = call(request, timeout=30)
            if method == "WatchVersions":
                list(itertools.islice(reply, 1))
    assert info.value.code() == EXPECTED[credential], info.value.details()
    assert stack.baseline() == before


# -- what the roles may do --------------------------------------------------------------------


def test_health_answers_without_a_token(stack: Stack) -> None:
    no_token = ClientAuth(insecure=True)
    tls = stack.sidecar.tls
    assert tls is not None
    over_mtls = ClientAuth(
        insecure=True, tls_ca=tls.ca, tls_cert=tls.client_cert, tls_key=tls.client_key
    )
    for target, auth in ((stack.trainer.target, no_token), (stack.sidecar.address, over_mtls)):
        with open_channel(target, auth) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_the_sidecar_refuses_a_client_without_a_certificate(stack: Stack) -> None:
    tls = stack.sidecar.tls
    assert tls is not None
    token = stack.sidecar.tokens.file(Role.RECEIVER)
    for auth in (
        ClientAuth(token_file=token, tls_ca=tls.ca),  # TLS, no client certificate
        ClientAuth(token_file=token),  # plaintext
    ):
        with SidecarClient(stack.sidecar.address, timeout=30, auth=auth) as client:
            with pytest.raises(grpc.RpcError) as info:
                client.latest_version()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_receiver_cannot_renew_or_release_another_receivers_lease(stack: Stack) -> None:
    with stack.sidecar.client(Role.RECEIVER, timeout=30) as other:
        mine = other.acquire_lease(1, "other", ttl=600)
        assert mine.receiver_id == "other" and stack.lease.receiver_id == "holder"
        assert mine.lease_id != stack.lease.lease_id and len(mine.lease_id) >= 20
        impostor = Lease(stack.lease.lease_id, 1, 0.0, receiver_id="other")
        with pytest.raises(UnknownLease, match="receiver 'other' holds no lease"):
            other.renew_lease(impostor, ttl=0.001)
        with pytest.raises(UnknownLease, match="receiver 'other' holds no lease"):
            other.release_lease(impostor)
        assert stack.holder.renew_lease(stack.lease, ttl=600).lease_id == stack.lease.lease_id
        other.release_lease(mine)
        with pytest.raises(UnknownLease):
            other.release_lease(mine)


def test_a_replaced_token_file_is_honoured_without_a_restart(stack: Stack) -> None:
    tokens = stack.trainer.tokens
    old = stack.workdir / "old-orchestrator-token"
    old.write_bytes(tokens.file(Role.ORCHESTRATOR).read_bytes())
    before = stack.trainer.client.status()
    write_token_dir(tokens.directory, [Role.ORCHESTRATOR])  # rotate: replace the file
    with open_channel(stack.trainer.target, ClientAuth(token_file=old)) as channel:
        with pytest.raises(grpc.RpcError) as info:
            trainer_pb2_grpc.TrainerServiceStub(channel).GetStatus(tpb.GetStatusRequest())
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # The trainer's own client reads the replaced file too.
    assert stack.trainer.client.status() == before


def test_the_open_step_finishes_as_if_nothing_had_been_refused(stack: Stack) -> None:
    status = stack.trainer.client.status()
    assert status.open_step.step_id == "open"
    result = stack.trainer.client.finish_step("open")
    assert result.weights_version == 2
    assert result.metrics.counts.microbatches == 1
    assert result.metrics.counts.sequences == BATCH.num_sequences
    assert stack.holder.wait_visible(2) == 2
