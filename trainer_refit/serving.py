"""gRPC plumbing both services share: start a server with the standard health service and
reflection, publish the bound port, wait for SIGTERM/SIGINT, stop gracefully."""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from trainer_refit.decoding import RequestDecoding
from trainer_refit.errors import InvalidRequest, internal_message, new_error_id
from trainer_refit.reflection import enable_reflection
from trainer_refit.status_details import error_status

log = logging.getLogger(__name__)

Reply = TypeVar("Reply")
Handler = Callable[..., Awaitable[Reply]]


def status_codes(
    table: Sequence[tuple[type[Exception], grpc.StatusCode]],
) -> Callable[[Handler[Reply]], Handler[Reply]]:
    """Decorates servicer methods: an exception of a listed type (the first match) becomes its
    status code with the exception's message, bounded (`errors.bounded`), and for an
    `InvalidRequest` naming a field a BadRequest detail naming it. Any other exception is a
    fault of the service: logged once with its traceback under a fresh error id, answered
    INTERNAL "internal error <id>; see the server log" (no exception text leaves the server)."""

    def decorate(method: Handler[Reply]) -> Handler[Reply]:
        @functools.wraps(method)
        async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Reply:
            try:
                return await method(self, request, context)
            except Exception as exc:
                code = next((c for kind, c in table if isinstance(exc, kind)), None)
                if code is None:
                    error_id = new_error_id()
                    log.exception("%s failed (error %s)", method.__name__, error_id)
                    status = error_status(grpc.StatusCode.INTERNAL, internal_message(error_id))
                else:
                    field = exc.field if isinstance(exc, InvalidRequest) else None
                    status = error_status(code, str(exc), field)
                await context.abort_with_status(status)
            raise AssertionError("unreachable")

        return wrapper

    return decorate


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
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> RunningServer:
    """Binds host:port (0 picks a free port), serves health (SERVING) and reflection (v1 and
    v1alpha); request bodies that do not parse are refused before any servicer
    (`decoding.RequestDecoding`). `credentials`: TLS (None: plaintext); `interceptors` run
    first, before the request is decoded (`auth.ServerAuth.interceptors`)."""
    server = grpc.aio.server(options=list(options), interceptors=[*interceptors, RequestDecoding()])
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(server, (service_name, health.SERVICE_NAME))
    if credentials is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        bound = server.add_secure_port(f"{host}:{port}", credentials)
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
