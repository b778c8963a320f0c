"""The ``authorization: Bearer <token>`` metadata: reading it on the server, and client
interceptors (blocking and grpc.aio) that add a token file's current token to every call.
Used through `trainer_refit.auth`."""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

import grpc

from trainer_refit.tokens import TokenFile

AUTHORIZATION = "authorization"
_SCHEME = "bearer"


def bearer_token(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The token of the first ``authorization: Bearer <token>`` entry (the scheme in any
    case); None without one."""
    for key, value in metadata:
        if key != AUTHORIZATION or not isinstance(value, str):
            continue
        scheme, _, token = value.partition(" ")
        if scheme.lower() == _SCHEME and token.strip():
            return token.strip()
    return None


def sync_interceptor(token: TokenFile) -> grpc.UnaryUnaryClientInterceptor:
    """For `grpc.intercept_channel`: every kind of call gets the token."""
    return _SyncBearer(token)


def aio_interceptors(token: TokenFile) -> list[grpc.aio.ClientInterceptor]:
    """For a grpc.aio channel's `interceptors` (one per kind of call)."""
    return [kind(token) for kind in _AIO_BEARERS]


def bearer_metadata(token: TokenFile) -> tuple[tuple[str, str], ...]:
    """The metadata of one call: the token file's current token (what the interceptors add)."""
    return _with_token((), token)


def _with_token(metadata: Any, token: TokenFile) -> tuple[tuple[str, str], ...]:
    return (*(tuple(metadata) if metadata else ()), (AUTHORIZATION, f"Bearer {token.read()[0]}"))


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class _SyncBearer(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: TokenFile) -> None:
        self._token = token

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            _with_token(details.metadata, self._token),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class _AioBearer:
    def __init__(self, token: TokenFile) -> None:
        self._token = token

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*_with_token(details.metadata, self._token))
        return details._replace(metadata=metadata)


class _AioUnaryUnary(_AioBearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioBearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioBearer, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _AioStreamStream(_AioBearer, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


_AIO_BEARERS = (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)
