"""The gRPC edge both services share (`trainer_refit.serving.start_server` and
`status_codes`), on a real grpc.aio server on port 0 with a small servicer: undecodable bodies
are refused before any servicer and logged once per client host; refusals carry bounded
messages and name their field in a google.rpc.BadRequest detail, which the clients expose;
unexpected failures answer INTERNAL with an error id only; reflection v1 and v1alpha both
answer real reflection clients."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from trainer_refit.auth import ClientAuth
from trainer_refit.decoding import RequestDecoding
from trainer_refit.errors import MAX_MESSAGE_BYTES, InvalidRequest, bounded, quoted
from trainer_refit.reflection import V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME, v1_messages
from trainer_refit.serving import RunningServer, start_server, status_codes
from trainer_refit.status_details import violated_field
from trainer_refit.v1 import trainer_pb2 as pb
from trainer_refit.v1 import trainer_pb2_grpc as pb_grpc
from trainer_svc import client
from trainer_svc.domain import AlreadyExists, InvalidArgument, LossConfig

T = TypeVar("T")
SERVICE = "trainer_refit.v1.TrainerService"


class Refused(RuntimeError):
    pass


_errors = status_codes(
    [
        (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
        (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
        (Refused, grpc.StatusCode.FAILED_PRECONDITION),
    ]
)


class EdgeServicer(pb_grpc.TrainerServiceServicer):
    """Refuses or fails on purpose; Forward answers and counts its calls."""

    def __init__(self) -> None:
        self.forward_calls = 0

    @_errors
    async def Forward(self, request: pb.ForwardRequest, context: Any) -> pb.ForwardResponse:  # noqa: N802
        self.forward_calls += 1
        return pb.ForwardResponse(top_k=request.top_k)

    @_errors
    async def BeginTrainStep(self, request: Any, context: Any) -> Any:  # noqa: N802
        raise InvalidArgument(f"step_id {quoted(request.step_id)} is refused", field="step_id")

    @_errors
    async def AbortTrainStep(self, request: Any, context: Any) -> Any:  # noqa: N802
        raise Refused(f"cannot abort step {request.step_id}")  # echoed whole: bounded at the edge

    @_errors
    async def FinishTrainStep(self, request: Any, context: Any) -> Any:  # noqa: N802
        raise AlreadyExists("exists already")

    @_errors
    async def GetStatus(self, request: Any, context: Any) -> Any:  # noqa: N802
        raise KeyError("a private detail")


class Served:
    """A server on its own event loop thread, with blocking clients in the test."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servicer = EdgeServicer()
        self.running: RunningServer = self.run(
            start_server(
                lambda server: pb_grpc.add_TrainerServiceServicer_to_server(self.servicer, server),
                SERVICE,
                host="localhost",
                port=0,
            )
        )
        self.target = f"127.0.0.1:{self.running.port}"
        self.channel = grpc.insecure_channel(self.target)

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    def raw(self, method: str) -> Any:
        return self.channel.unary_unary(f"/{SERVICE}/{method}")

    def close(self) -> None:
        self.channel.close()
        self.run(self.running.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


@contextmanager
def serving() -> Iterator[Served]:
    served = Served()
    try:
        yield served
    finally:
        served.close()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serving() as served:
        yield served


def _error(call: Any, *args: Any, **kwargs: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=10, **kwargs)
    return info.value


# -- undecodable bodies --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [b"\xff", b"\x0a\x05\x0a\x03\xff\xff\xff", b"\x0a\x10\x0a", b"\x0b", b"\x12\x80"],
    ids=["bad varint", "bad nested varint", "length past the end", "unmatched group", "truncated"],
)
def test_undecodable_unary_body_is_refused_before_the_servicer(served: Served, body: bytes) -> None:
    calls = served.servicer.forward_calls
    error = _error(served.raw("Forward"), body)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "request body is not a valid trainer_refit.v1.ForwardRequest"
    assert served.servicer.forward_calls == calls
    reply = served.raw("Forward")(pb.ForwardRequest(top_k=3).SerializeToString(), timeout=10)
    assert pb.ForwardResponse.FromString(reply).top_k == 3
    assert served.servicer.forward_calls == calls + 1


def test_undecodable_streaming_bodies_are_refused(served: Served) -> None:
    watch = served.channel.unary_stream("/grpc.health.v1.Health/Watch")
    with pytest.raises(grpc.RpcError) as info:
        next(watch(b"\xff", timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "grpc.health.v1.HealthCheckRequest" in (info.value.details() or "")
    for service in (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME):
        reflect = served.channel.stream_stream(f"/{service}/ServerReflectionInfo")
        with pytest.raises(grpc.RpcError) as info:
            list(reflect(iter([b"\xff\xff"]), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, service
        assert "ServerReflectionRequest" in (info.value.details() or ""), service


def _undecodable_records(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    return [r for r in records if r.name == "trainer_refit.decoding"]


def test_undecodable_bodies_are_logged_once_per_client_host(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="trainer_refit.decoding")
    with serving() as served:
        for _ in range(3):  # a new connection each time: another port of the same host
            with grpc.insecure_channel(served.target) as channel:
                for _ in range(5):
                    error = _error(channel.unary_unary(f"/{SERVICE}/GetStatus"), b"\xff")
                    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        records = _undecodable_records(caplog.records)
        assert len(records) == 1
        assert records[0].levelno == logging.WARNING and records[0].exc_info is None
        assert "ipv4:127.0.0.1" in records[0].getMessage()
        assert "Traceback" not in caplog.text

        with grpc.insecure_channel(f"[::1]:{served.running.port}") as channel:
            error = _error(channel.unary_unary(f"/{SERVICE}/GetStatus"), b"\xff")
        if error.code() == grpc.StatusCode.UNAVAILABLE:
            pytest.skip("no IPv6 loopback to call from another host")
        assert len(_undecodable_records(caplog.records)) == 2  # another host


def test_the_hosts_remembered_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    """With room for one host, a host seen before another is logged again."""
    caplog.set_level(logging.WARNING, logger="trainer_refit.decoding")

    async def run() -> list[grpc.StatusCode]:
        server = grpc.aio.server(interceptors=[RequestDecoding(max_peers=1)])
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("localhost:0")
        await server.start()
        codes = []
        try:
            for host in ("127.0.0.1", "[::1]", "127.0.0.1"):
                async with grpc.aio.insecure_channel(f"{host}:{port}") as channel:
                    call = channel.unary_unary("/grpc.health.v1.Health/Check")
                    try:
                        await call(b"\xff", timeout=10)
                    except grpc.RpcError as error:
                        codes.append(error.code())
        finally:
            await server.stop(0)
        return codes

    codes = asyncio.run(run())
    if grpc.StatusCode.UNAVAILABLE in codes:
        pytest.skip("no IPv6 loopback to call from another host")
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 3
    assert len(_undecodable_records(caplog.records)) == 3


# -- refusals and failures ---------------------------------------------------------------------


def test_a_refused_field_is_named_in_the_status_details(served: Served) -> None:
    step_id = "s" * 20000
    stub = pb_grpc.TrainerServiceStub(served.channel)
    error = _error(stub.BeginTrainStep, pb.BeginTrainStepRequest(step_id=step_id))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violated_field(error) == "step_id"
    assert error.details() == f"step_id {quoted(step_id)} is refused"
    assert "(20000 characters)" in error.details()

    translated = client._translate(error)
    assert isinstance(translated, InvalidArgument) and translated.field == "step_id"
    with client.TrainerClient(served.target, auth=ClientAuth(insecure=True)) as trainer:
        with pytest.raises(InvalidArgument) as info:
            trainer.begin_step("s", LossConfig())
        assert info.value.field == "step_id"
        with pytest.raises(AlreadyExists, match=r"^exists already$"):
            trainer.finish_step("s")


def test_errors_without_a_field_carry_no_field(served: Served) -> None:
    stub = pb_grpc.TrainerServiceStub(served.channel)
    error = _error(stub.FinishTrainStep, pb.FinishTrainStepRequest(step_id="s"))
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    assert violated_field(error) is None


@pytest.mark.parametrize("character", ["x", "é", "☃"])
def test_a_huge_echo_keeps_its_status_code(served: Served, character: str) -> None:
    """A message echoing 20,000 characters would exceed the client's 8 KiB metadata limit
    (and arrive as RESOURCE_EXHAUSTED); bounded, it arrives as sent."""
    stub = pb_grpc.TrainerServiceStub(served.channel)
    error = _error(stub.AbortTrainStep, pb.AbortTrainStepRequest(step_id=character * 20000))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = error.details() or ""
    assert details.startswith("cannot abort step " + character * 10)
    assert len(details.encode()) <= MAX_MESSAGE_BYTES


def test_an_unexpected_failure_is_internal_with_an_id_only(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="trainer_refit.serving")
    stub = pb_grpc.TrainerServiceStub(served.channel)
    error = _error(stub.GetStatus, pb.GetStatusRequest())
    assert error.code() == grpc.StatusCode.INTERNAL
    details = error.details() or ""
    match = re.fullmatch(r"internal error ([0-9a-f]{12}); see the server log", details)
    assert match, details
    records = [r for r in caplog.records if r.name == "trainer_refit.serving"]
    assert len(records) == 1 and records[0].exc_info is not None
    assert match.group(1) in records[0].getMessage()
    assert "KeyError" in caplog.text and "private detail" in caplog.text


def test_quoted_and_bounded() -> None:
    assert quoted("abc") == "'abc'"
    assert quoted("a" * 100, limit=4) == "'aaaa'... (100 characters)"
    assert bounded("short") == "short"
    cut = bounded("é" * 1000, limit=101)
    assert len(cut.encode()) <= 101 and cut.endswith(" [...]") and set(cut[:-6]) == {"é"}


# -- reflection ---------------------------------------------------------------------------------

EXPECTED_SERVICES = {
    SERVICE,
    "grpc.health.v1.Health",
    V1_SERVICE_NAME,
    V1ALPHA_SERVICE_NAME,
}


def test_reflection_v1alpha_answers_its_client(served: Served) -> None:
    database = ProtoReflectionDescriptorDatabase(served.channel)
    assert set(database.get_services()) == EXPECTED_SERVICES
    pool = descriptor_pool.DescriptorPool(database)
    methods = {m.name for m in pool.FindServiceByName(SERVICE).methods}
    assert {"BeginTrainStep", "TrainMicrobatch", "GetStatus"} <= methods


def test_reflection_v1_answers_a_v1_client(served: Served) -> None:
    request_v1, response_v1 = v1_messages()
    assert request_v1.DESCRIPTOR.full_name == "grpc.reflection.v1.ServerReflectionRequest"
    reflect = served.channel.stream_stream(
        f"/{V1_SERVICE_NAME}/ServerReflectionInfo",
        request_serializer=request_v1.SerializeToString,
        response_deserializer=response_v1.FromString,
    )
    requests = [request_v1(list_services="")]
    requests += [request_v1(file_containing_symbol=name) for name in sorted(EXPECTED_SERVICES)]
    replies = list(reflect(iter(requests), timeout=10))
    listed = {s.name for s in replies[0].list_services_response.service}
    assert listed == EXPECTED_SERVICES
    for name, reply in zip(sorted(EXPECTED_SERVICES), replies[1:], strict=True):
        assert reply.WhichOneof("message_response") == "file_descriptor_response", name
        pool = descriptor_pool.DescriptorPool()
        protos = [
            descriptor_pb2.FileDescriptorProto.FromString(blob)
            for blob in reply.file_descriptor_response.file_descriptor_proto
        ]
        added: set[str] = set()
        while len(added) < len(protos):  # dependencies first
            for proto in protos:
                if proto.name not in added and set(proto.dependency) <= added:
                    pool.AddSerializedFile(proto.SerializeToString())
                    added.add(proto.name)
        assert pool.FindServiceByName(name).methods, name


def test_health_still_serves(served: Served) -> None:
    health = health_pb2_grpc.HealthStub(served.channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING  # streams through
    watch.cancel()
