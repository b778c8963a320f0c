"""Request bodies that do not parse are refused at the edge, before any servicer sees them.

gRPC's own handling of a request its deserializer cannot parse is to log a full traceback and
answer UNKNOWN naming a Python exception, once per request. `RequestDecoding` (a server
interceptor) wraps every method's request deserializer instead: a body that fails to parse
becomes an `Undecodable` marker, which the wrapped method answers with INVALID_ARGUMENT
("request body is not a valid <message>") without calling the servicer. INVALID_ARGUMENT and
not INTERNAL (the code gRPC's libraries use for an unparseable request): the bytes are the
caller's fault and nothing changed, and INTERNAL stays reserved for faults of the service.

Each client (peer host) that sends such a body is logged once, as a WARNING without a
traceback; the set of hosts remembered is bounded (least recently seen forgotten first).
Streaming requests are checked as the servicer iterates them; a servicer that reads them with
`context.read()` instead would see the `Undecodable` marker itself (none here does).
"""

from __future__ import annotations

import inspect
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError

from trainer_refit.status_details import error_status

log = logging.getLogger(__name__)

MAX_REMEMBERED_PEERS = 1024


@dataclass(frozen=True)
class Undecodable:
    """What a request deserializer returns for bytes that are not a valid `message`."""

    message: str
    reason: str


def _message_name(deserializer: Callable[[bytes], Any]) -> str:
    owner = getattr(deserializer, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", "request message")


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    name = _message_name(deserializer)

    def deserialize(body: bytes) -> Any:
        try:
            return deserializer(body)
        except DecodeError as exc:
            return Undecodable(name, str(exc))

    return deserialize


def _peer_host(peer: str) -> str:
    """ "ipv4:10.0.0.7:53412" -> "ipv4:10.0.0.7": a client's connections share one entry."""
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return f"{kind}:{address.rpartition(':')[0] or address}"
    return peer


class RequestDecoding(grpc.aio.ServerInterceptor):
    """Refuses undecodable request bodies with INVALID_ARGUMENT (see the module doc)."""

    def __init__(self, max_peers: int = MAX_REMEMBERED_PEERS) -> None:
        if max_peers < 1:
            raise ValueError(f"max_peers must be >= 1, got {max_peers}")
        self._max_peers = max_peers
        self._logged: OrderedDict[str, None] = OrderedDict()
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}
        """Per method: the handler gRPC found and its wrapped twin, built once rather than
        for every call."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        replaced = self._wrap(method, handler)
        self._wrapped[method] = (handler, replaced)
        return replaced

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        wrapped: dict[str, Any] = {"request_deserializer": _tolerant(handler.request_deserializer)}
        if handler.unary_unary is not None:
            wrapped["unary_unary"] = self._unary_unary(method, handler.unary_unary)
        if handler.unary_stream is not None:
            wrapped["unary_stream"] = self._unary_stream(method, handler.unary_stream)
        if handler.stream_unary is not None:
            wrapped["stream_unary"] = self._stream_unary(method, handler.stream_unary)
        if handler.stream_stream is not None:
            wrapped["stream_stream"] = self._stream_stream(method, handler.stream_stream)
        return handler._replace(**wrapped)

    async def _refuse(self, method: str, request: Undecodable, context: Any) -> NoReturn:
        host = _peer_host(context.peer() or "unknown peer")
        if host in self._logged:
            self._logged.move_to_end(host)
        else:
            self._logged[host] = None
            if len(self._logged) > self._max_peers:
                self._logged.popitem(last=False)
            log.warning(
                "%s sent %s a body that is not a valid %s (%s); further undecodable requests "
                "from this client are refused without a log line",
                host,
                method,
                request.message,
                request.reason,
            )
        status = error_status(
            grpc.StatusCode.INVALID_ARGUMENT, f"request body is not a valid {request.message}"
        )
        await context.abort_with_status(status)
        raise AssertionError("abort_with_status returned")

    def _unary_unary(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def call(request: Any, context: Any) -> Any:
            if isinstance(request, Undecodable):
                await self._refuse(method, request, context)
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result

        return call

    def _unary_stream(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def call(request: Any, context: Any) -> AsyncIterator[Any]:
            if isinstance(request, Undecodable):
                await self._refuse(method, request, context)
            async for reply in _replies(behavior(request, context)):
                yield reply

        return call

    def _checked(self, method: str, requests: Any, context: Any) -> AsyncIterator[Any]:
        async def iterate() -> AsyncIterator[Any]:
            async for request in _aiter(requests):
                if isinstance(request, Undecodable):
                    await self._refuse(method, request, context)
                yield request

        return iterate()

    def _stream_unary(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def call(requests: Any, context: Any) -> Any:
            result = behavior(self._checked(method, requests, context), context)
            return await result if inspect.isawaitable(result) else result

        return call

    def _stream_stream(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def call(requests: Any, context: Any) -> AsyncIterator[Any]:
            checked = self._checked(method, requests, context)
            async for reply in _replies(behavior(checked, context)):
                yield reply

        return call


async def _aiter(items: Any) -> AsyncIterator[Any]:
    if hasattr(items, "__aiter__"):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


async def _replies(result: Any) -> AsyncIterator[Any]:
    """The replies of a streaming method: an (async) iterator of them, or none when it wrote
    them itself with `context.write` (then `result` is a coroutine, or None)."""
    if inspect.isawaitable(result):
        result = await result
    if result is None:
        return
    async for reply in _aiter(result):
        yield reply
