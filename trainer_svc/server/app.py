"""Assembles the trainer's grpc.aio server: trainer service, health service, reflection, and
the callers' authentication (`server.access`, docs/security.md)."""

from __future__ import annotations

import logging

from trainer_refit.serving import RunningServer, start_server
from trainer_refit.v1 import trainer_pb2, trainer_pb2_grpc
from trainer_svc.config import ServerConfig
from trainer_svc.runtime.control import Leader
from trainer_svc.server.access import METHOD_ROLES
from trainer_svc.server.servicer import TrainerServicer
from trainer_svc.server.status import ServiceInfo

log = logging.getLogger(__name__)

SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name


async def create_server(leader: Leader, info: ServiceInfo, config: ServerConfig) -> RunningServer:
    servicer = TrainerServicer(leader, info)
    running = await start_server(
        lambda server: trainer_pb2_grpc.add_TrainerServiceServicer_to_server(servicer, server),
        SERVICE_NAME,
        host=config.host,
        port=config.port,
        options=[
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
        ],
        credentials=config.auth.credentials(),
        interceptors=config.auth.interceptors(METHOD_ROLES),
    )
    level = logging.WARNING if config.auth.insecure else logging.INFO
    log.log(level, "authentication: %s", config.auth.describe())
    return running
