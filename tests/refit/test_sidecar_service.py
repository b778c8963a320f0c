"""The refit-sidecar process over gRPC: versions become readable only when every rank published,
leased versions are never retired, the all-slots-leased policy applies, unknown versions are
NOT_FOUND."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from refit_sidecar.client import SidecarClient
from tests.support.sidecar import running_sidecar
from trainer_refit.v1 import common_pb2
from trainer_refit.v1 import refit_pb2 as pb
from trainer_refit.v1 import refit_pb2_grpc as pb_grpc


@pytest.fixture
def start_sidecar(tmp_path):
    numbers = itertools.count()
    with ExitStack() as stack:

        def start(*args: str) -> pb_grpc.RefitServiceStub:
            workdir = tmp_path / f"sidecar-{next(numbers)}"
            address = stack.enter_context(running_sidecar(workdir, *args))
            channel = grpc.insecure_channel(address)
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest()).status == (
                health_pb2.HealthCheckResponse.SERVING
            )
            return pb_grpc.RefitServiceStub(channel)

        yield start


def _publish(stub, version: int, rank: int) -> bool:
    shard = pb.ShardRecord(
        location=pb.ShardLocation(agent=f"rank-{rank}", address=4096 * (rank + 1), nbytes=64),
        pieces=[pb.ShardPiece(box=pb.Box(start=[rank * 4, 0], stop=[rank * 4 + 4, 4]))],
        rank=rank,
        tensor_rank=rank,
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


def _register(stub, world_size: int, slots: int) -> None:
    layout = common_pb2.ParallelLayout(tensor_parallel=world_size, world_size=world_size)
    stub.RegisterTrainer(pb.RegisterTrainerRequest(layout=layout, num_slots=slots))


def _code(call, request) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call(request)
    assert info.value.details()
    return info.value.code()


def test_versions_manifests_and_leases(start_sidecar):
    stub = start_sidecar("--when-all-slots-leased", "fail")
    assert stub.GetLatestVersion(pb.GetLatestVersionRequest()).version == 0
    assert _code(stub.GetManifest, pb.GetManifestRequest(version=1)) == grpc.StatusCode.NOT_FOUND
    _register(stub, world_size=2, slots=1)

    assert stub.ReserveSlot(pb.ReserveSlotRequest(version=1)).slot == 0
    assert _publish(stub, 1, rank=0) is False
    assert _code(stub.GetManifest, pb.GetManifestRequest(version=1)) == grpc.StatusCode.NOT_FOUND
    assert _publish(stub, 1, rank=1) is True
    assert stub.GetLatestVersion(pb.GetLatestVersionRequest()).version == 1
    manifest = stub.GetManifest(pb.GetManifestRequest(version=1))
    assert [a.name for a in manifest.agents] == ["rank-0", "rank-1"]
    (parameter,) = manifest.parameters
    assert [s.rank for s in parameter.shards] == [0, 1]
    assert manifest.layout.world_size == 2

    lease = stub.AcquireLease(pb.AcquireLeaseRequest(version=1, receiver_id="r", ttl_seconds=60))
    exhausted = _code(stub.ReserveSlot, pb.ReserveSlotRequest(version=2))
    assert exhausted == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stub.GetManifest(pb.GetManifestRequest(version=1)).version == 1
    stub.RenewLease(pb.RenewLeaseRequest(lease_id=lease.lease_id, ttl_seconds=60))
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease.lease_id))
    reply = stub.ReserveSlot(pb.ReserveSlotRequest(version=2))
    assert (reply.slot, reply.retired_version) == (0, 1)
    assert _code(stub.GetManifest, pb.GetManifestRequest(version=1)) == grpc.StatusCode.NOT_FOUND
    gone = pb.ReleaseLeaseRequest(lease_id=lease.lease_id)
    assert _code(stub.ReleaseLease, gone) == grpc.StatusCode.NOT_FOUND
    bad_ttl = pb.AcquireLeaseRequest(version=1, receiver_id="r", ttl_seconds=-1)
    assert _code(stub.AcquireLease, bad_ttl) in (
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.INVALID_ARGUMENT,
    )


def test_wait_policy_waits_for_an_expiring_lease_and_watchers_see_new_versions(start_sidecar):
    stub = start_sidecar("--when-all-slots-leased", "wait", "--max-wait-seconds", "120")
    _register(stub, world_size=1, slots=1)
    stub.ReserveSlot(pb.ReserveSlotRequest(version=1))
    _publish(stub, 1, rank=0)
    watch = stub.WatchVersions(pb.WatchVersionsRequest(after_version=0))
    assert next(watch).version == 1
    stub.AcquireLease(pb.AcquireLeaseRequest(version=1, receiver_id="r", ttl_seconds=0.5))
    reply = stub.ReserveSlot(pb.ReserveSlotRequest(version=2))
    assert reply.retired_version == 1
    _publish(stub, 2, rank=0)
    assert next(watch).version == 2
    watch.cancel()


def test_a_reservation_waits_for_the_last_report_of_the_previous_version(start_sidecar):
    stub = start_sidecar("--when-all-slots-leased", "fail", "--publish-timeout-seconds", "1")
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
    with running_sidecar(tmp_path / "sidecar") as address, SidecarClient(address) as client:
        stub = pb_grpc.RefitServiceStub(grpc.insecure_channel(address))
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


def test_leases_carry_a_manifest_key_equal_for_versions_of_the_same_slot(tmp_path):
    with running_sidecar(tmp_path / "sidecar") as address, SidecarClient(address) as client:
        stub = pb_grpc.RefitServiceStub(grpc.insecure_channel(address))
        _register(stub, world_size=1, slots=2)

        def publish(version: int, crc: int) -> bytes:
            slot = stub.ReserveSlot(pb.ReserveSlotRequest(version=version)).slot
            request = pb.PublishShardsRequest(
                version=version,
                rank=0,
                agent=pb.SourceAgent(name="rank-0", metadata=b"meta", rank=0),
                parameters=[
                    pb.ParameterRecord(
                        name="w",
                        shape=[4],
                        dtype=common_pb2.DTYPE_FLOAT32,
                        shards=[
                            pb.ShardRecord(
                                location=pb.ShardLocation(
                                    agent="rank-0", address=4096 * (slot + 1), nbytes=16
                                ),
                                pieces=[pb.ShardPiece(box=pb.Box(start=[0], stop=[4]))],
                                crc32=crc,
                            )
                        ],
                    )
                ],
            )
            assert stub.PublishShards(request).visible
            lease = client.acquire_lease(version, "r", ttl=30)
            client.release_lease(lease)
            assert client.checksums(version) == {"w": (crc,)}
            return lease.manifest_key

        first, second, third = publish(1, crc=11), publish(2, crc=22), publish(3, crc=33)
        assert len(first) == 16 and first == third  # slot 0 again; only version and CRC differ
        assert second != first  # slot 1: other addresses
        renewed = client.renew_lease(client.acquire_lease(3, "r", ttl=30), ttl=30)
        assert renewed.manifest_key == b""
