"""Server reflection under both of its names: ``grpc.reflection.v1.ServerReflection`` (what
current tools ask for first) and ``grpc.reflection.v1alpha.ServerReflection``.

The installed grpcio-reflection implements v1alpha only. v1 is the same protocol: its
messages are v1alpha's, field for field, in package ``grpc.reflection.v1``. So v1 calls are
answered by the same reflection servicer through an adapter that re-reads each v1 request as
the v1alpha one and writes the v1alpha replies as they are (the bytes are the same). So that
v1 can itself be described over reflection, its file descriptor (v1alpha's, renamed) is added
to the default descriptor pool once, unless the installed grpcio-reflection brings its own.
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FileDescriptor
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA_SERVICE_NAME: str = reflection.SERVICE_NAME
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1_FILE_NAME = "grpc/reflection/v1/reflection.proto"
_METHOD = "ServerReflectionInfo"


def _renamed(type_name: str) -> str:
    old = f".{reflection_pb2.DESCRIPTOR.package}."
    return f".{V1_PACKAGE}." + type_name[len(old) :] if type_name.startswith(old) else type_name


def v1_file_descriptor() -> FileDescriptor:
    """The descriptor of ``grpc/reflection/v1/reflection.proto`` in the default pool (added
    on first use, derived from v1alpha's)."""
    pool = descriptor_pool.Default()
    try:
        return pool.FindFileByName(V1_FILE_NAME)
    except KeyError:
        pass
    try:  # a grpcio-reflection that ships v1 registers it on import
        importlib.import_module("grpc_reflection.v1.reflection_pb2")
        return pool.FindFileByName(V1_FILE_NAME)
    except (ImportError, KeyError):
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name = V1_FILE_NAME
    proto.package = V1_PACKAGE
    proto.ClearField("options")
    for message in proto.message_type:
        for field in message.field:
            if field.type_name:
                field.type_name = _renamed(field.type_name)
    for service in proto.service:
        for method in service.method:
            method.input_type = _renamed(method.input_type)
            method.output_type = _renamed(method.output_type)
    pool.AddSerializedFile(proto.SerializeToString())
    return pool.FindFileByName(V1_FILE_NAME)


def v1_messages() -> tuple[type[Any], type[Any]]:
    """The v1 ``ServerReflectionRequest`` and ``ServerReflectionResponse`` classes (what a v1
    client sends and reads)."""
    file = v1_file_descriptor()
    return (
        message_factory.GetMessageClass(file.message_types_by_name["ServerReflectionRequest"]),
        message_factory.GetMessageClass(file.message_types_by_name["ServerReflectionResponse"]),
    )


class _V1Reflection:
    """Serves v1 calls with the v1alpha servicer: requests re-read as v1alpha messages (the
    same bytes), replies written as they are (v1 reads the same bytes)."""

    def __init__(self, servicer: Any) -> None:
        self._servicer = servicer

    async def ServerReflectionInfo(  # noqa: N802 (the RPC's name)
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[reflection_pb2.ServerReflectionResponse]:
        async def as_v1alpha() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
            async for request in requests:
                yield reflection_pb2.ServerReflectionRequest.FromString(request.SerializeToString())

        async for reply in self._servicer.ServerReflectionInfo(as_v1alpha(), context):
            yield reply


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Serves reflection v1 and v1alpha on `server`, listing `service_names` and both
    reflection services."""
    request_v1, _ = v1_messages()
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1_handler = grpc.stream_stream_rpc_method_handler(
        _V1Reflection(servicer).ServerReflectionInfo,
        request_deserializer=request_v1.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {_METHOD: v1_handler}),)
    )
