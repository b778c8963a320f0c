"""The token check and TLS on a tiny real grpc.aio server (port 0, in a thread of this
process): refused calls never reach their handler, the role decides, health stays open,
replaced token and certificate files are honoured without a restart, mutual TLS refuses a
client without a certificate."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.support.auth import TlsFiles, Tokens
from trainer_refit.auth import (
    ClientAuth,
    MethodRoles,
    Role,
    ServerAuth,
    call_metadata,
    open_aio_channel,
    open_channel,
    write_token_dir,
)

SAY, WATCH, OTHER = "/test.Echo/Say", "/test.Echo/Watch", "/test.Echo/Other"
TABLE: MethodRoles = {SAY: frozenset({Role.ORCHESTRATOR}), WATCH: frozenset({Role.RECEIVER})}
"""`Other` is served but missing from the table: refused to every role."""


class Echo:
    """test.Echo: Say (unary), Watch (two replies), Other; records each call it runs."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def say(self, request: bytes, context: Any) -> bytes:
        self.calls.append("Say")
        return request

    async def watch(self, request: bytes, context: Any) -> Any:
        self.calls.append("Watch")
        yield request
        yield request

    async def other(self, request: bytes, context: Any) -> bytes:
        self.calls.append("Other")
        return request

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            "test.Echo",
            {
                "Say": grpc.unary_unary_rpc_method_handler(self.say),
                "Watch": grpc.unary_stream_rpc_method_handler(self.watch),
                "Other": grpc.unary_unary_rpc_method_handler(self.other),
            },
        )


@contextmanager
def serving(auth: ServerAuth) -> Iterator[tuple[str, Echo]]:
    """A grpc.aio server with `auth` on its own event loop thread; yields (target, Echo)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    echo = Echo()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(interceptors=auth.interceptors(TABLE))
        server.add_generic_rpc_handlers((echo.handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        credentials = auth.credentials()
        if credentials is None:
            port = server.add_insecure_port("127.0.0.1:0")
        else:
            port = server.add_secure_port("127.0.0.1:0", credentials)
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield f"127.0.0.1:{port}", echo
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Tokens:
    return Tokens.create(tmp_path_factory.mktemp("auth") / "tokens")


@pytest.fixture(scope="module")
def server(tokens: Tokens) -> Iterator[tuple[str, Echo]]:
    with serving(ServerAuth(token_dir=tokens.directory)) as running:
        yield running


def _call(target: str, auth: ClientAuth, method: str, metadata: Any = None) -> list[bytes]:
    """The replies of `method` (a list, for the stream too)."""
    with open_channel(target, auth) as channel:
        if method == WATCH:
            return list(channel.unary_stream(method)(b"hi", timeout=10, metadata=metadata))
        return [channel.unary_unary(method)(b"hi", timeout=10, metadata=metadata)]


def _code(target: str, auth: ClientAuth, method: str, metadata: Any = None) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        _call(target, auth, method, metadata)
    return info.value.code()


NO_TOKEN = ClientAuth(insecure=True)


@pytest.mark.parametrize("method", [SAY, WATCH, OTHER])
def test_calls_without_a_valid_token_are_unauthenticated_and_never_run(
    server: tuple[str, Echo], tmp_path: Path, method: str
) -> None:
    target, echo = server
    before = list(echo.calls)
    assert _code(target, NO_TOKEN, method) == grpc.StatusCode.UNAUTHENTICATED
    stranger = write_token_dir(tmp_path / "stranger")
    for role in Role:
        wrong = ClientAuth(token_file=stranger / role.value)
        assert _code(target, wrong, method) == grpc.StatusCode.UNAUTHENTICATED
    for header in ("Basic abc", "Bearer ", "Bearer", "bearer x", "Token x"):
        metadata = (("authorization", header),)
        assert _code(target, NO_TOKEN, method, metadata) == grpc.StatusCode.UNAUTHENTICATED
    assert echo.calls == before


def test_only_the_roles_a_method_allows_get_through(
    server: tuple[str, Echo], tokens: Tokens
) -> None:
    target, echo = server
    before = list(echo.calls)
    for role in (Role.TRAINER, Role.RECEIVER):
        assert _code(target, tokens.client(role), SAY) == grpc.StatusCode.PERMISSION_DENIED
    for role in (Role.TRAINER, Role.ORCHESTRATOR):
        assert _code(target, tokens.client(role), WATCH) == grpc.StatusCode.PERMISSION_DENIED
    for role in Role:  # not in the table: fail closed
        assert _code(target, tokens.client(role), OTHER) == grpc.StatusCode.PERMISSION_DENIED
    assert echo.calls == before
    assert _call(target, tokens.client(Role.ORCHESTRATOR), SAY) == [b"hi"]
    assert _call(target, tokens.client(Role.RECEIVER), WATCH) == [b"hi", b"hi"]
    assert echo.calls == [*before, "Say", "Watch"]


def test_the_refusal_names_the_role_and_the_method(server: tuple[str, Echo], tokens: Tokens):
    target, _ = server
    with pytest.raises(grpc.RpcError) as info:
        _call(target, tokens.client(Role.RECEIVER), SAY)
    assert info.value.details() == (
        "the receiver role may not call /test.Echo/Say (allowed: orchestrator)"
    )


def test_health_answers_without_a_token(server: tuple[str, Echo]) -> None:
    target, _ = server
    with open_channel(target, NO_TOKEN) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_the_asyncio_channel_sends_the_token(server: tuple[str, Echo], tokens: Tokens) -> None:
    target, _ = server

    async def calls() -> tuple[bytes, list[bytes]]:
        async with open_aio_channel(target, tokens.client(Role.ORCHESTRATOR)) as channel:
            said = await channel.unary_unary(SAY)(b"hi", timeout=10)
        async with open_aio_channel(target, tokens.client(Role.RECEIVER)) as channel:
            watched = [r async for r in channel.unary_stream(WATCH)(b"hi", timeout=10)]
        return said, watched

    assert asyncio.run(calls()) == (b"hi", [b"hi", b"hi"])


def test_a_replaced_token_file_is_honoured_without_a_restart(
    server: tuple[str, Echo], tokens: Tokens, tmp_path: Path
) -> None:
    target, _ = server
    old = tmp_path / "old-token"
    old.write_bytes(tokens.file(Role.ORCHESTRATOR).read_bytes())
    client = tokens.client(Role.ORCHESTRATOR)
    with open_channel(target, client) as channel:
        say = channel.unary_unary(SAY)
        assert say(b"before", timeout=10) == b"before"
        write_token_dir(tokens.directory, [Role.ORCHESTRATOR])  # rotate: replace the file
        assert say(b"after", timeout=10) == b"after"  # the client read the new token
    assert _code(target, ClientAuth(token_file=old), SAY) == grpc.StatusCode.UNAUTHENTICATED


def test_a_channel_without_the_interceptor_sends_the_token_as_call_metadata(
    server: tuple[str, Echo], tokens: Tokens
) -> None:
    """`open_channel(bearer=False)` adds nothing; `call_metadata` gives each call the token
    file's current token (what `SidecarClient` sends), a replaced file's from then on."""
    target, _ = server
    client = tokens.client(Role.ORCHESTRATOR)
    metadata = call_metadata(client)
    with open_channel(target, client, bearer=False) as channel:
        say = channel.unary_unary(SAY)
        with pytest.raises(grpc.RpcError) as refused:
            say(b"bare", timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert say(b"before", timeout=10, metadata=metadata()) == b"before"
        write_token_dir(tokens.directory, [Role.ORCHESTRATOR])  # rotate: replace the file
        assert say(b"after", timeout=10, metadata=metadata()) == b"after"
    assert call_metadata(ClientAuth(token_file=None, insecure=True))() == ()


def test_a_token_file_of_several_lines_rotates_without_refusing_anyone(
    server: tuple[str, Echo], tokens: Tokens, tmp_path: Path
) -> None:
    target, _ = server
    path = tokens.file(Role.ORCHESTRATOR)
    old = tmp_path / "old"
    old.write_bytes(path.read_bytes())
    new = write_token_dir(tmp_path / "new", [Role.ORCHESTRATOR]) / Role.ORCHESTRATOR.value
    both = tmp_path / "both"
    both.write_bytes(new.read_bytes() + b"\n" + old.read_bytes())
    both.replace(path)  # the new token first: clients reading this file switch to it
    for client in (
        ClientAuth(token_file=old),
        ClientAuth(token_file=new),
        tokens.client(Role.ORCHESTRATOR),
    ):
        assert _call(target, client, SAY) == [b"hi"]
    staged = tmp_path / "staged"
    staged.write_bytes(new.read_bytes())
    staged.replace(path)  # every client has the new token: drop the old one
    assert _code(target, ClientAuth(token_file=old), SAY) == grpc.StatusCode.UNAUTHENTICATED
    assert _call(target, tokens.client(Role.ORCHESTRATOR), SAY) == [b"hi"]


def test_an_unreadable_or_shared_token_authorises_nobody(
    server: tuple[str, Echo], tokens: Tokens, tmp_path: Path
) -> None:
    target, _ = server
    saved = tmp_path / "saved"
    saved.write_bytes(tokens.file(Role.ORCHESTRATOR).read_bytes())
    client = ClientAuth(token_file=saved)
    try:
        tokens.file(Role.ORCHESTRATOR).write_text("\n")
        assert _code(target, client, SAY) == grpc.StatusCode.UNAUTHENTICATED
        # The receiver's file now holds the orchestrator's token too: neither role matches.
        receiver = tokens.file(Role.RECEIVER).read_bytes()
        tokens.file(Role.ORCHESTRATOR).write_bytes(saved.read_bytes())
        tokens.file(Role.RECEIVER).write_bytes(saved.read_bytes())
        assert _code(target, client, SAY) == grpc.StatusCode.UNAUTHENTICATED
        tokens.file(Role.RECEIVER).write_bytes(receiver)
        assert _call(target, client, SAY) == [b"hi"]
    finally:
        tokens.file(Role.ORCHESTRATOR).write_bytes(saved.read_bytes())


def test_a_service_does_not_start_without_the_token_files_it_needs(tmp_path: Path) -> None:
    write_token_dir(tmp_path, [Role.ORCHESTRATOR, Role.TRAINER])
    auth = ServerAuth(token_dir=tmp_path)
    with pytest.raises(ValueError, match=r"receiver: No such file or directory: .*receiver"):
        auth.interceptors(TABLE)
    (tmp_path / Role.TRAINER.value).write_bytes((tmp_path / "orchestrator").read_bytes())
    write_token_dir(tmp_path, [Role.RECEIVER])
    with pytest.raises(ValueError, match="roles orchestrator and trainer share a token"):
        auth.interceptors(TABLE)
    assert ServerAuth(insecure=True).interceptors(TABLE) == []


# -- TLS --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    from tests.support.certs import make_tls_files

    return make_tls_files(tmp_path_factory.mktemp("tls"))


def test_tls_carries_the_token_and_refuses_plaintext(tokens: Tokens, tls: TlsFiles) -> None:
    auth = ServerAuth(token_dir=tokens.directory, tls_cert=tls.server_cert, tls_key=tls.server_key)
    token = tokens.file(Role.ORCHESTRATOR)
    with serving(auth) as (target, _):
        assert _call(target, ClientAuth(token_file=token, tls_ca=tls.ca), SAY) == [b"hi"]
        assert _code(target, ClientAuth(token_file=token), SAY) == grpc.StatusCode.UNAVAILABLE
        no_token = ClientAuth(insecure=True, tls_ca=tls.ca)
        assert _code(target, no_token, SAY) == grpc.StatusCode.UNAUTHENTICATED


def test_mutual_tls_refuses_a_client_without_a_certificate(
    tokens: Tokens, tls: TlsFiles, tmp_path: Path
) -> None:
    from tests.support.certs import make_tls_files

    auth = ServerAuth(
        token_dir=tokens.directory,
        tls_cert=tls.server_cert,
        tls_key=tls.server_key,
        tls_client_ca=tls.ca,
    )
    token = tokens.file(Role.ORCHESTRATOR)
    with_cert = ClientAuth(
        token_file=token, tls_ca=tls.ca, tls_cert=tls.client_cert, tls_key=tls.client_key
    )
    other = make_tls_files(tmp_path, "other")
    foreign_cert = ClientAuth(
        token_file=token, tls_ca=tls.ca, tls_cert=other.client_cert, tls_key=other.client_key
    )
    with serving(auth) as (target, echo):
        assert _call(target, with_cert, SAY) == [b"hi"]
        without = ClientAuth(token_file=token, tls_ca=tls.ca)
        assert _code(target, without, SAY) == grpc.StatusCode.UNAVAILABLE
        assert _code(target, foreign_cert, SAY) == grpc.StatusCode.UNAVAILABLE
        assert echo.calls == ["Say"]


def test_replaced_server_certificates_serve_new_connections(tokens: Tokens, tmp_path: Path) -> None:
    from tests.support.certs import make_tls_files

    first, second = make_tls_files(tmp_path, "first"), make_tls_files(tmp_path, "second")
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    cert.write_bytes(first.server_cert.read_bytes())
    key.write_bytes(first.server_key.read_bytes())
    token = tokens.file(Role.ORCHESTRATOR)
    with serving(ServerAuth(token_dir=tokens.directory, tls_cert=cert, tls_key=key)) as (
        target,
        _,
    ):
        assert _call(target, ClientAuth(token_file=token, tls_ca=first.ca), SAY) == [b"hi"]
        for source, path in ((second.server_cert, cert), (second.server_key, key)):
            staged = path.with_suffix(".new")
            staged.write_bytes(source.read_bytes())
            staged.replace(path)
        assert _call(target, ClientAuth(token_file=token, tls_ca=second.ca), SAY) == [b"hi"]
        stale = ClientAuth(token_file=token, tls_ca=first.ca)
        assert _code(target, stale, SAY) == grpc.StatusCode.UNAVAILABLE


def test_known_tokens_are_digested_once_per_file_not_per_call(
    tokens: Tokens, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer_refit import tokens as token_module

    digested: list[str] = []
    digest = token_module._digest
    monkeypatch.setattr(token_module, "_digest", lambda t: digested.append(t) or digest(t))
    roles = token_module.RoleTokens(tokens.directory, [Role.ORCHESTRATOR])
    mine = tokens.file(Role.ORCHESTRATOR).read_text().split()[0]
    assert roles.role_of(mine) is Role.ORCHESTRATOR
    first = len(digested)
    assert roles.role_of(mine) is Role.ORCHESTRATOR
    assert len(digested) == first + 1  # the presented token only
    write_token_dir(tmp_path / "new", [Role.ORCHESTRATOR])
    (tmp_path / "new" / Role.ORCHESTRATOR.value).replace(tokens.file(Role.ORCHESTRATOR))
    assert roles.role_of(mine) is None  # rotated away: the new file's token is digested
    rotated = tokens.file(Role.ORCHESTRATOR).read_text().split()[0]
    assert roles.role_of(rotated) is Role.ORCHESTRATOR
