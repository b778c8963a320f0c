"""gRPC plumbing both services share: start a server with the standard health service and
reflection, publish the bound port, wait for SIGTERM/SIGINT, stop gracefully."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer

    async def stop(self, grace_seconds: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_seconds)


async def start_server(
    add_servicers: Callable[[grpc.aio.Server], None],
    service_name: str,
    *,
    host: str,
    port: int,
    options: Sequence[tuple[str, int]] = (),
) -> RunningServer:
    """Binds host:port (0 picks a free port), serves health (SERVING) and reflection."""
    server = grpc.aio.server(options=list(options))
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    await server.start()
    for name in ("", service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, bound, health_servicer)


def write_port_file(path: Path | None, port: int) -> None:
    """Atomically writes the bound port, so a reader never sees a partial number."""
    if path is None:
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(port))
    tmp.replace(path)


async def wait_for_stop_signal() -> signal.Signals:
    loop = asyncio.get_running_loop()
    stop: asyncio.Future[signal.Signals] = loop.create_future()

    def received(sig: signal.Signals) -> None:
        if not stop.done():
            stop.set_result(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, received, sig)
    return await stop
