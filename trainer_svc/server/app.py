"""Assembles the grpc.aio server: trainer service, standard health service, reflection."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from trainer_refit.v1 import trainer_pb2, trainer_pb2_grpc
from trainer_svc.config import ServerConfig
from trainer_svc.runtime.control import Leader
from trainer_svc.server.servicer import TrainerServicer
from trainer_svc.server.status import ServiceInfo

SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name


async def create_server(
    leader: Leader, info: ServiceInfo, config: ServerConfig
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Builds and starts the server; returns it, the bound port and its health servicer."""
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
    ]
    server = grpc.aio.server(options=options)
    trainer_pb2_grpc.add_TrainerServiceServicer_to_server(TrainerServicer(leader, info), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise OSError(f"could not bind {config.host}:{config.port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer
