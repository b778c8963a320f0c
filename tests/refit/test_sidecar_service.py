"""The refit-sidecar process over gRPC: versions become readable only when every rank published,
leased versions are never retired, the all-slots-leased policy applies, unknown versions are
NOT_FOUND. The trainer's calls go with the trainer role's token, the receivers' with the
receiver role's."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any, NamedTuple

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from refit_sidecar.service.client import InvalidRequest, TrainerLayout, UnknownVersion
from refit_sidecar.service.pending import CallCancelled
from tests.support.sidecar import running_sidecar
from trainer_refit.auth import Role
from trainer_refit.reflection import V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME, v1_messages
from trainer_refit.v1 import common_pb2
from trainer_refit.v1 import refit_pb2 as pb
from trainer_refit.v1 import refit_pb2_grpc as pb_grpc


class _Fenced:
    """A trainer-side method that presents the registration's generation when the request
    names none, as the trainer's own client does."""

    def __init__(self, trainer: TrainerStub, method: Any) -> None:
        self._trainer = trainer
        self._method = method

    def _fill(self, request: Any) -> Any:
        if not request.generation:
            request.generation = self._trainer.generation
        return request

    def __call__(self, request: Any, **kwargs: Any) -> Any:
        return self._method(self._fill(request), **kwargs)

    def future(self, request: Any, **kwargs: Any) -> Any:
        return self._method.future(self._fill(request), **kwargs)


class TrainerStub:
    """The trainer role's stub: registers as one owner and presents its last registration's
    generation in reservations, reports and renewals."""

    def __init__(self, stub: pb_grpc.RefitServiceStub) -> None:
        self._stub = stub
        self.generation = 0

    def RegisterTrainer(self, request: pb.RegisterTrainerRequest, **kwargs: Any) -> Any:  # noqa: N802 (the stub's name)
        if not request.owner:
            request.owner = "test-trainer"
        reply = self._stub.RegisterTrainer(request, **kwargs)
        self.generation = reply.generation
        return reply

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)
        if name in ("ReserveSlot", "PublishShards", "RenewRegistration"):
            return _Fenced(self, method)
        return method


class Stubs(NamedTuple):
    trainer: TrainerStub
    receiver: pb_grpc.RefitServiceStub


@pytest.fixture
def start_sidecar(tmp_path):
    numbers = itertools.count()
    with ExitStack() as stack:

        def start(*args: str) -> Stubs:
            workdir = tmp_path / f"sidecar-{next(numbers)}"
            sidecar = stack.enter_context(running_sidecar(workdir, *args))
            trainer, receiver = (
                stack.enter_context(sidecar.channel(role)) for role in (Role.TRAINER, Role.RECEIVER)
            )
            health = health_pb2_grpc.HealthStub(receiver)
            assert health.Check(health_pb2.HealthCheckRequest()).status == (
                health_pb2.HealthCheckResponse.SERVING
            )
            return Stubs(
                TrainerStub(pb_grpc.RefitServiceStub(trainer)), pb_grpc.RefitServiceStub(receiver)
            )

        yield start


def _publish(stub, version: int, rank: int, crc32: int | None = None) -> bool:
    shard = pb.ShardRecord(
        location=pb.ShardLocation(
            agent=f"rank-{rank}",
            address=4096 * (rank + 1),
            nbytes=64,
            shape=[4, 4],
            strides=[4, 1],
            memory=pb.MEMORY_KIND_DRAM,
        ),
        pieces=[
            pb.ShardPiece(
                box=pb.Box(start=[rank * 4, 0], stop=[rank * 4 + 4, 4]), local_start=[0, 0]
            )
        ],
        rank=rank,
        tensor_rank=rank,
        crc32=crc32,
        wsum64=None if crc32 is None else crc32 << 40,
    )
    request = pb.PublishShardsRequest(
        version=version,
        rank=rank,
        agent=pb.SourceAgent(name=f"rank-{rank}", metadata=b"meta", rank=rank),
        parameters=[
            pb.ParameterRecord(
                name="decoder.layers.0.mlp.linear_fc2.weight",
                shape=[8, 4],
                dtype=common_pb2.DTYPE_FLOAT32,
                shards=[shard],
            )
        ],
    )
    return stub.PublishShards(request).visible


def test_a_report_that_does_not_parse_is_refused_and_changes_nothing(start_sidecar):
    trainer, stub = start_sidecar()
    _register(trainer, world_size=2, slots=1)
    assert trainer.ReserveSlot(pb.ReserveSlotRequest(version=1)).slot == 0
    good = pb.PublishShardsRequest()
    original = trainer.PublishShards

    def capture(request):
        good.CopyFrom(request)
        return original(request)

    trainer.PublishShards = capture
    assert _publish(trainer, 1, rank=0) is False
    trainer.PublishShards = original
    outside = pb.PublishShardsRequest()
    outside.CopyFrom(good)
    outside.parameters[0].shards[0].pieces[0].box.stop[0] = 9  # past the tensor's 8 rows
    foreign = pb.PublishShardsRequest()
    foreign.CopyFrom(good)
    foreign.parameters[0].shards[0].location.agent = "rank-1"  # another rank's memory
    misnamed = pb.PublishShardsRequest()
    misnamed.CopyFrom(good)
    misnamed.rank = 1  # its agent says rank 0
    for bad, error in (
        (outside, "outside"),
        (foreign, "unknown agent 'rank-1'"),
        (misnamed, "names agent rank 0"),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            trainer.PublishShards(bad)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error in refused.value.details(), refused.value.details()
    # Nothing was recorded: rank 1's own report makes version 1 readable, as rank 0's does.
    assert _code(stub.GetManifest, pb.GetManifestRequest(version=1)) == grpc.StatusCode.NOT_FOUND
    assert _publish(trainer, 1, rank=1) is True
    manifest = stub.GetManifest(pb.GetManifestRequest(version=1))
    assert [a.name for a in manifest.agents] == ["rank-0", "rank-1"]
    # A report of an already checked layout differs in its version and checksums alone.
    assert trainer.ReserveSlot(pb.ReserveSlotRequest(version=2)).slot == 0
    assert _publish(trainer, 2, rank=0, crc32=7) is False


def _register(stub, world_size: int, slots: int) -> None:
    layout = common_pb2.ParallelLayout(tensor_parallel=world_size, world_size=world_size)
    stub.RegisterTrainer(pb.RegisterTrainerRequest(layout=layout, num_slots=slots))


def _code(call, request) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call(request)
    assert info.value.details()
    return info.value.code()


def test_versions_manifests_and_leases(start_sidecar):
    trainer, stub = start_sidecar("--when-all-slots-leased", "fail")
    assert stub.GetLatestVersion(pb.GetLatestVersionRequest()).version == 0
    assert _code(stub.GetManifest, pb.GetManifestRequest(version=1)) == grpc.StatusCode.NOT_FOUND
    _register(trainer, world_size=2, slots=1)

    assert trainer.ReserveSlot(pb.ReserveSlotRequest(version=1)).slot == 0
    assert _publish(trainer, 1, rank=0) is False
    assert _code(stub.GetManifest, pb.GetManifestRequest(version=1)) == grpc.StatusCode.NOT_FOUND
    assert _publish(trainer, 1, rank=1) is True
    assert stub.GetLatestVersion(pb.GetLatestVersionRequest()).version == 1
    manifest = stub.GetManifest(pb.GetManifestRequest(version=1))
    assert [a.name for a in manifest.agents] == ["rank-0", "rank-1"]
    (parameter,) = manifest.parameters
    assert [s.rank for s in parameter.shards] == [0, 1]
    assert manifest.layout.world_size == 2

    lease = stub.AcquireLease(pb.AcquireLeaseRequest(version=1, receiver_id="r", ttl_seconds=60))
    assert lease.receiver_id == "r"
    exhausted = _code(trainer.ReserveSlot, pb.ReserveSlotRequest(version=2))
    assert exhausted == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stub.GetManifest(pb.GetManifestRequest(version=1)).version == 1
    stub.RenewLease(pb.RenewLeaseRequest(lease_id=lease.lease_id, receiver_id="r", ttl_seconds=60))
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease.lease_id, receiver_id="r"))
    reply = trainer.ReserveSlot(pb.ReserveSlotRequest(version=2))
    assert (reply.slot, reply.retired_version) == (0, 1)
    assert _code(stub.GetManifest, pb.GetManifestRequest(version=1)) == grpc.StatusCode.NOT_FOUND
    gone = pb.ReleaseLeaseRequest(lease_id=lease.lease_id, receiver_id="r")
    assert _code(stub.ReleaseLease, gone) == grpc.StatusCode.NOT_FOUND
    bad_ttl = pb.AcquireLeaseRequest(version=1, receiver_id="r", ttl_seconds=-1)
    assert _code(stub.AcquireLease, bad_ttl) in (
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.INVALID_ARGUMENT,
    )


def test_wait_policy_waits_for_an_expiring_lease_and_watchers_see_new_versions(
    start_sidecar,
):
    trainer, stub = start_sidecar("--when-all-slots-leased", "wait", "--max-wait-seconds", "120")
    _register(trainer, world_size=1, slots=1)
    trainer.ReserveSlot(pb.ReserveSlotRequest(version=1))
    _publish(trainer, 1, rank=0)
    watch = stub.WatchVersions(pb.WatchVersionsRequest(after_version=0), timeout=60)
    assert next(watch).version == 1
    stub.AcquireLease(pb.AcquireLeaseRequest(version=1, receiver_id="r", ttl_seconds=0.5))
    reply = trainer.ReserveSlot(pb.ReserveSlotRequest(version=2))
    assert reply.retired_version == 1
    _publish(trainer, 2, rank=0)
    assert next(watch).version == 2
    # A restarted trainer registers again and numbers its versions afresh: the watch hears
    # that nothing is readable (0), then goes on with the new trainer's versions.
    _register(trainer, world_size=1, slots=1)
    assert next(watch).version == 0
    trainer.ReserveSlot(pb.ReserveSlotRequest(version=1))
    _publish(trainer, 1, rank=0)
    assert next(watch).version == 1
    watch.cancel()


def test_a_reservation_waits_for_the_last_report_of_the_previous_version(start_sidecar):
    stub, _ = start_sidecar("--when-all-slots-leased", "fail", "--publish-timeout-seconds", "1")
    _register(stub, world_size=2, slots=1)
    stub.ReserveSlot(pb.ReserveSlotRequest(version=1))
    _publish(stub, 1, rank=0)
    reserve = stub.ReserveSlot.future(pb.ReserveSlotRequest(version=2))
    time.sleep(0.2)
    assert not reserve.done()  # held until rank 1 reports version 1
    assert _publish(stub, 1, rank=1) is True
    assert reserve.result().retired_version == 1

    _publish(stub, 2, rank=1)  # rank 0 never reports version 2
    with pytest.raises(grpc.RpcError) as info:
        stub.ReserveSlot(pb.ReserveSlotRequest(version=3))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "ranks [0] have not reported it after 1 s" in info.value.details()


def test_wait_visible_returns_when_the_last_rank_reports(tmp_path):
    with running_sidecar(tmp_path / "sidecar") as sidecar, sidecar.client() as client:
        stub = TrainerStub(sidecar.stub(Role.TRAINER))
        _register(stub, world_size=2, slots=2)
        stub.ReserveSlot(pb.ReserveSlotRequest(version=1))
        _publish(stub, 1, rank=0)
        with pytest.raises(TimeoutError, match="version 1 did not become readable"):
            client.wait_visible(1, timeout=0.3)
        with ThreadPoolExecutor(1) as pool:
            waited = pool.submit(client.wait_visible, 1, 30.0)
            time.sleep(0.2)
            assert not waited.done()
            _publish(stub, 1, rank=1)
            assert waited.result() == 1
        assert client.wait_visible(1, timeout=0.3) == 1  # readable already: at once


def test_a_lease_call_waits_for_the_version_and_carries_its_checksums(tmp_path):
    """AcquireLease with wait_seconds: a version not readable yet is leased as soon as its last
    rank reports (one call from the step's return to the first read); one superseded, or
    not readable in time, is NOT_FOUND; a bad wait is INVALID_ARGUMENT. With with_checksums
    the lease carries every shard's checksums in GetManifest's order."""
    with running_sidecar(tmp_path / "sidecar") as sidecar, sidecar.client() as client:
        stub = TrainerStub(sidecar.stub(Role.TRAINER))
        _register(stub, world_size=2, slots=2)
        stub.ReserveSlot(pb.ReserveSlotRequest(version=1))
        _publish(stub, 1, rank=0, crc32=10)
        start = time.monotonic()
        with pytest.raises(UnknownVersion, match="version 1 is not readable"):
            client.acquire_lease(1, "r", ttl=30, wait_s=0.3)
        assert time.monotonic() - start >= 0.3
        with ThreadPoolExecutor(1) as pool:
            leasing = pool.submit(client.acquire_lease, 1, "r", 30, wait_s=30.0, checksums=True)
            time.sleep(0.2)
            assert not leasing.done()
            _publish(stub, 1, rank=1)
            lease = leasing.result(timeout=10)
        assert lease.version == 1 and lease.expires_at <= time.monotonic() + 30
        manifest = sidecar.stub(Role.RECEIVER).GetManifest(pb.GetManifestRequest(version=1))
        flat = [
            (s.crc32 if s.HasField("crc32") else None, s.wsum64 if s.HasField("wsum64") else None)
            for p in manifest.parameters
            for s in p.shards
        ]
        assert flat == [(10, 10 << 40), (None, None)]
        assert lease.checksums is not None and [tuple(c) for c in lease.checksums] == flat
        plain = client.acquire_lease(1, "r", ttl=30)
        assert plain.checksums is None  # not asked for
        client.release_lease(plain)
        for wait in (-1.0, float("nan"), 1e9):
            with pytest.raises(InvalidRequest, match="wait_seconds"):
                client.acquire_lease(1, "r", ttl=30, wait_s=wait)
        client.release_lease(lease)
        stub.ReserveSlot(pb.ReserveSlotRequest(version=2))
        for rank in (0, 1):
            _publish(stub, 2, rank=rank)
        stub.ReserveSlot(pb.ReserveSlotRequest(version=3))
        for rank in (0, 1):
            _publish(stub, 3, rank=rank)
        # Version 1's slot went to version 3: it can never become readable again.
        start = time.monotonic()
        with pytest.raises(UnknownVersion):
            client.acquire_lease(1, "r", ttl=30, wait_s=30.0)
        assert time.monotonic() - start < 5


def test_a_restarted_trainers_version_carries_its_own_checksums(tmp_path):
    """A trainer that registers again numbers its versions afresh: its version 1 is leased and
    described with the checksums it reported, never those of the earlier trainer's version 1."""
    with running_sidecar(tmp_path / "sidecar") as sidecar, sidecar.client() as client:
        stub = TrainerStub(sidecar.stub(Role.TRAINER))
        for generation_crc in (10, 20):
            _register(stub, world_size=1, slots=1)
            stub.ReserveSlot(pb.ReserveSlotRequest(version=1))
            _publish(stub, 1, rank=0, crc32=generation_crc)
            lease = client.acquire_lease(1, "r", ttl=30, checksums=True)
            assert lease.checksums is not None
            assert [tuple(c) for c in lease.checksums] == [(generation_crc, generation_crc << 40)]
            assert list(client.checksums(1).values()) == [((generation_crc, generation_crc << 40),)]
            client.release_lease(lease)


def test_a_lease_asked_later_is_answered_when_the_version_comes_or_cancelled(tmp_path):
    """`lease_later`: the call stays in flight until the version is readable and then gives
    what `acquire_lease` would (its errors too); a call cancelled while it waits holds
    nothing once the version comes."""
    fail = ("--when-all-slots-leased", "fail")
    with running_sidecar(tmp_path / "sidecar", *fail) as sidecar, sidecar.client() as client:
        stub = TrainerStub(sidecar.stub(Role.TRAINER))
        _register(stub, world_size=1, slots=1)
        with pytest.raises(UnknownVersion, match="version 1 is not readable"):
            client.lease_later(1, "r", 30, wait_s=0.2).result(timeout=10)
        waiting = client.lease_later(1, "r", 30, wait_s=30.0, checksums=True)
        cancelled = client.lease_later(1, "s", 30, wait_s=30.0)
        time.sleep(0.2)
        assert not waiting.done() and not cancelled.done()
        assert cancelled.cancel()
        with pytest.raises(CallCancelled):
            cancelled.result()
        stub.ReserveSlot(pb.ReserveSlotRequest(version=1))
        _publish(stub, 1, rank=0, crc32=7)
        lease = waiting.result(timeout=10)
        assert lease.version == 1 and lease.receiver_id == "r"
        # When the version became readable and when the answer was built, by the sidecar's
        # clock (this host's): the parked call was answered after the publication, a later
        # lease of the version names the same moment, a renewal neither.
        assert 0 < lease.readable_at <= lease.answered_at <= time.time()
        again = client.acquire_lease(1, "s", ttl=30)
        assert again.readable_at == lease.readable_at and again.answered_at > lease.answered_at
        client.release_lease(again)
        renewed = client.renew_lease(lease, 30)
        assert renewed.readable_at == renewed.answered_at == 0
        assert lease.checksums is not None and [tuple(c) for c in lease.checksums] == [(7, 7 << 40)]
        assert not waiting.cancel()  # answered: nothing to cancel
        client.release_lease(lease)
        # Only the cancelled call could hold version 1 now, and it holds nothing: the one
        # slot goes to version 2 at once (this sidecar refuses rather than waits).
        stub.ReserveSlot(pb.ReserveSlotRequest(version=2))


def _publish_one_tensor(
    stub, version: int, slot: int, crc: int, describe: tuple[int, ...] = ()
) -> None:
    """Rank 0 of a one-rank trainer reports `version`: one tensor "w" of 4 floats at an
    address of `slot`, with its CRC-32, and the layouts of slots `describe`; the version
    becomes readable."""
    request = _one_tensor_report(version, slot, crc)
    for other in describe:
        layout = _one_tensor_report(0, other, None)
        request.slot_layouts.add(slot=other, agent=layout.agent, parameters=layout.parameters)
    assert stub.PublishShards(request).visible


def _one_tensor_report(version: int, slot: int, crc: int | None) -> pb.PublishShardsRequest:
    shard = pb.ShardRecord(
        location=pb.ShardLocation(
            agent="rank-0",
            address=4096 * (slot + 1),
            nbytes=16,
            shape=[4],
            strides=[1],
            memory=pb.MEMORY_KIND_DRAM,
        ),
        pieces=[pb.ShardPiece(box=pb.Box(start=[0], stop=[4]), local_start=[0])],
        crc32=crc,
    )
    return pb.PublishShardsRequest(
        version=version,
        rank=0,
        agent=pb.SourceAgent(name="rank-0", metadata=b"meta", rank=0),
        parameters=[
            pb.ParameterRecord(name="w", shape=[4], dtype=common_pb2.DTYPE_FLOAT32, shards=[shard])
        ],
    )


def test_a_slot_the_trainer_described_is_leased_early_with_its_layout(tmp_path):
    """The layouts of its other slots that a rank sends with its first report make the first
    version into each of them leased at its reservation, pending, with the key its manifest
    will have; GetManifest with `reserved` gives that layout (no checksums), and the version's
    manifest once readable has the key its lease named. A bad layout refuses the report and
    records nothing."""
    with running_sidecar(tmp_path / "sidecar") as sidecar, sidecar.client() as client:
        stub = TrainerStub(sidecar.stub(Role.TRAINER))
        _register(stub, world_size=1, slots=3)
        reserve = lambda v: stub.ReserveSlot(pb.ReserveSlotRequest(version=v)).slot  # noqa: E731
        assert reserve(1) == 0
        for bad, field in [((3,), "slot 3"), ((1, 1), "given twice")]:
            with pytest.raises(grpc.RpcError) as info:
                _publish_one_tensor(stub, 1, 0, crc=11, describe=bad)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in info.value.details()
        foreign = _one_tensor_report(1, 0, 11)
        layout = _one_tensor_report(0, 1, None)
        layout.agent.name = "rank-9"
        foreign.slot_layouts.add(slot=1, agent=layout.agent, parameters=layout.parameters)
        assert _code(stub.PublishShards, foreign) == grpc.StatusCode.INVALID_ARGUMENT
        assert client.latest_version() is None  # nothing recorded
        with pytest.raises(UnknownVersion):
            client.pending_manifest(2)  # not reserved

        _publish_one_tensor(stub, 1, 0, crc=11, describe=(1, 2))
        asked = client.lease_later(2, "r", 30, wait_s=20, checksums=True, before_readable=True)
        assert reserve(2) == 1
        lease = asked.result(timeout=10)
        assert lease.pending and lease.checksums is None and lease.manifest_key
        raw = sidecar.stub(Role.RECEIVER).GetManifest(
            pb.GetManifestRequest(version=2, reserved=True)
        )
        assert raw.pending and not raw.parameters[0].shards[0].HasField("crc32")
        manifest, key = client.pending_manifest(2)
        assert key == lease.manifest_key and manifest.version == 2
        (shard,) = manifest.parameters[0].shards
        # Where slot 1's shard lies, with placeholders of the checksums its memory gets.
        assert shard.location.address == 4096 * 2 and (shard.crc32, shard.sum64) == (0, 0)
        with pytest.raises(UnknownVersion):
            client.manifest(2)  # not readable: only asked for as reserved
        _publish_one_tensor(stub, 2, 1, crc=22)
        assert client.pending_manifest(2)[1] == lease.manifest_key  # readable: its manifest
        assert client.checksums(2) == {"w": ((22, None),)}
        client.release_lease(lease)


def test_leases_carry_a_manifest_key_equal_for_versions_of_the_same_slot(tmp_path):
    with running_sidecar(tmp_path / "sidecar") as sidecar, sidecar.client() as client:
        stub = TrainerStub(sidecar.stub(Role.TRAINER))
        _register(stub, world_size=1, slots=2)

        def publish(version: int, crc: int) -> bytes:
            slot = stub.ReserveSlot(pb.ReserveSlotRequest(version=version)).slot
            _publish_one_tensor(stub, version, slot, crc)
            lease = client.acquire_lease(version, "r", ttl=30)
            client.release_lease(lease)
            assert client.checksums(version) == {"w": ((crc, None),)}
            return lease.manifest_key

        first, second, third = publish(1, crc=11), publish(2, crc=22), publish(3, crc=33)
        assert len(first) == 16 and first == third  # slot 0 again; only version and CRC differ
        assert second != first  # slot 1: other addresses
        renewed = client.renew_lease(client.acquire_lease(3, "r", ttl=30), ttl=30)
        assert renewed.manifest_key == b""


def test_a_lease_before_readable_comes_at_the_reservation_and_holds_the_slot(tmp_path):
    """`before_readable`: a version whose slot held a readable version (its manifest key known,
    whether or not anyone read that version) is leased as soon as it is reserved, pending,
    with that key and no checksums; the leased slot is never handed on; GetChecksums answers
    once the version is readable, with the key. A slot that never held a readable version
    gives a lease only once the version is readable."""
    with running_sidecar(tmp_path / "sidecar") as sidecar, sidecar.client() as client:
        stub = TrainerStub(sidecar.stub(Role.TRAINER))
        _register(stub, world_size=1, slots=2)

        def reserve(version: int) -> int:
            return stub.ReserveSlot(pb.ReserveSlotRequest(version=version)).slot

        def early(version: int):
            return client.lease_later(
                version, "r", 30, wait_s=20, checksums=True, before_readable=True
            )

        # Slot 0 was never readable: the lease waits for the version to be.
        first = early(1)
        assert reserve(1) == 0
        time.sleep(0.3)
        assert not first.done()
        _publish_one_tensor(stub, 1, 0, crc=11)
        lease = first.result()
        assert not lease.pending and lease.checksums == ((11, None),)
        slot_key = lease.manifest_key
        client.release_lease(lease)
        _publish_one_tensor(stub, 2, reserve(2), crc=22)  # slot 1; no one reads version 2

        # Slot 0 again: leased at its reservation, before any report.
        third = early(3)
        time.sleep(0.2)
        assert not third.done()  # not reserved yet
        assert reserve(3) == 0
        lease = third.result(timeout=10)
        assert lease.pending and lease.checksums is None and lease.readable_at == 0
        assert lease.manifest_key == slot_key
        asked = client.checksums_later(3, wait_s=20)
        time.sleep(0.2)
        assert not asked.done() and not asked.answered()
        _publish_one_tensor(stub, 3, 0, crc=33)
        got = asked.result(timeout=10)
        assert asked.answered()  # readable: what a piece gate may open on
        assert (got.version, got.checksums) == (3, ((33, None),))
        assert got.manifest_key == lease.manifest_key
        # Slot 1 held version 2, which no one read: its key is known all the same.
        fourth = early(4)
        assert reserve(4) == 1
        ahead = fourth.result(timeout=10)
        assert ahead.pending and ahead.checksums is None
        _publish_one_tensor(stub, 4, 1, crc=44)
        after = client.acquire_lease(4, "r", ttl=30)
        assert not after.pending and after.manifest_key == ahead.manifest_key != slot_key
        client.release_lease(after)
        client.release_lease(ahead)
        # Version 3's slot stays with it while the lease lasts, readable or not.
        assert reserve(5) == 1  # not slot 0: version 3 is leased
        client.release_lease(lease)
        unknown = client.checksums_later(99, wait_s=0.2)
        with pytest.raises(UnknownVersion):
            unknown.result()
        assert unknown.done() and not unknown.answered()  # refused: not readable


def test_malformed_requests_are_refused_at_the_edge(tmp_path):
    """A body that does not parse is INVALID_ARGUMENT before any handler, logged once and
    without a traceback; the client raises refusals as InvalidRequest (a ValueError); both
    reflection versions list the service."""
    log_path = tmp_path / "sidecar.log"
    with (
        running_sidecar(tmp_path / "sidecar", log_path=log_path) as sidecar,
        sidecar.channel(Role.RECEIVER) as channel,
        sidecar.client(Role.TRAINER) as trainer,
    ):
        for method in ("GetManifest", "AcquireLease", "RenewLease", "GetLatestVersion"):
            call = channel.unary_unary(f"/trainer_refit.v1.RefitService/{method}")
            with pytest.raises(grpc.RpcError) as info:
                call(b"\x0a\x10\xff", timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert info.value.details().startswith("request body is not a valid trainer_refit.v1.")
        watch = channel.unary_stream("/trainer_refit.v1.RefitService/WatchVersions")
        with pytest.raises(grpc.RpcError) as info:
            next(watch(b"\xff", timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        with pytest.raises(InvalidRequest, match="num_slots") as refused:
            trainer.register_trainer(TrainerLayout(), num_slots=0, owner="test")
        assert isinstance(refused.value, ValueError) and refused.value.field == "num_slots"

        request_v1, response_v1 = v1_messages()
        for service, request, response in [
            (V1_SERVICE_NAME, request_v1, response_v1),
            (
                V1ALPHA_SERVICE_NAME,
                reflection_pb2.ServerReflectionRequest,
                reflection_pb2.ServerReflectionResponse,
            ),
        ]:
            reflect = channel.stream_stream(
                f"/{service}/ServerReflectionInfo",
                request_serializer=request.SerializeToString,
                response_deserializer=response.FromString,
            )
            (reply,) = reflect(iter([request(list_services="")]), timeout=10)
            names = {s.name for s in reply.list_services_response.service}
            assert "trainer_refit.v1.RefitService" in names, service
            assert {V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME} <= names, service
    log = log_path.read_text(errors="replace")
    assert log.count("a body that is not a valid") == 1
    assert "Traceback" not in log
