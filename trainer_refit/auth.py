"""Who may call what, for both gRPC services and every client (torch-free).

Callers authenticate with a bearer token (``authorization: Bearer <token>``) and each token
belongs to one `Role`; each service declares which roles may call each of its methods
(`method_roles`), and a method it does not list is refused (fail closed). Tokens live in files,
one per role, named by the role's value (``<dir>/orchestrator``, ``<dir>/trainer``,
``<dir>/receiver``): a Kubernetes Secret mounted as a directory gives exactly that. Files are
re-read when they change, so rotating a token is replacing its file. TLS is optional, and so is
mutual TLS (a client CA). The health and reflection services stay open. docs/security.md has
the whole model.

Server side: `ServerAuth` -> `credentials()` (None: plaintext) and `interceptors(table)`.
Client side: `ClientAuth` -> `open_channel` / `open_aio_channel`, which add the token to every
call. This module is the one to import; token files live in `tokens.py`, the bearer metadata
and the client interceptors in `bearer.py`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor

from trainer_refit.bearer import (
    AUTHORIZATION,
    aio_interceptors,
    bearer_metadata,
    bearer_token,
    sync_interceptor,
)
from trainer_refit.tokens import Role, RoleTokens, TokenFile, describe_error, write_token_dir

__all__ = [
    "AUTHORIZATION",
    "OPEN_SERVICES",
    "ClientAuth",
    "MethodRoles",
    "Role",
    "RoleTokens",
    "ServerAuth",
    "TokenDir",
    "TokenFile",
    "TokenInterceptor",
    "method_roles",
    "open_aio_channel",
    "open_channel",
    "roles_in",
    "write_token_dir",
]

log = logging.getLogger(__name__)

OPEN_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)
"""Services anyone may call: probes and tooling need them, and they expose no state."""


MethodRoles = Mapping[str, frozenset[Role]]
"""Full method name (``/package.Service/Method``) -> the roles that may call it."""


def method_roles(service: ServiceDescriptor, table: Mapping[str, Iterable[Role]]) -> MethodRoles:
    """A service's access table from {method name: roles}; names must be methods of `service`."""
    known = {method.name for method in service.methods}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"{service.full_name} has no methods {unknown}; it has {sorted(known)}")
    return {f"/{service.full_name}/{name}": frozenset(roles) for name, roles in table.items()}


def roles_in(table: MethodRoles) -> frozenset[Role]:
    """The roles a service with access table `table` serves (whose token files it needs)."""
    return frozenset(role for allowed in table.values() for role in allowed)


# -- server side ------------------------------------------------------------------------------


def _read(path: Path) -> bytes:
    return path.read_bytes()


@dataclass(frozen=True, kw_only=True)
class ServerAuth:
    """How a service authenticates its callers: bearer tokens from `token_dir`, or nobody at
    all when `insecure` (exactly one of the two); optionally TLS, and mutual TLS with
    `tls_client_ca`."""

    token_dir: Path | None = None
    """One token file per role, named by the role's value; re-read when a file changes."""
    tls_cert: Path | None = None
    """PEM certificate chain of the server; with `tls_key`, the service speaks TLS only."""
    tls_key: Path | None = None
    """PEM private key of `tls_cert`."""
    tls_client_ca: Path | None = None
    """PEM CA bundle: clients must present a certificate it signed (mutual TLS)."""
    insecure: bool = False
    """Accept every caller without a token (a trusted network, a test)."""

    def __post_init__(self) -> None:
        if (self.token_dir is None) == (not self.insecure):
            raise ValueError(
                "authentication needs a token directory (one file per role), or insecure "
                f"mode explicitly; got token_dir={self.token_dir}, insecure={self.insecure}"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(
                f"TLS needs both a certificate and its key; got tls_cert={self.tls_cert}, "
                f"tls_key={self.tls_key}"
            )
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError(
                f"a client CA ({self.tls_client_ca}) needs TLS: give the server a certificate "
                "and key too"
            )

    def check(self, roles: Iterable[Role]) -> None:
        """ValueError when a file this service needs is missing or invalid: the token file of
        each of `roles` and the TLS files (so a bad configuration fails at start-up)."""
        for path in (self.tls_cert, self.tls_key, self.tls_client_ca):
            if path is not None and not path.is_file():
                raise ValueError(f"TLS file {path} does not exist")
        if self.token_dir is not None:
            if not self.token_dir.is_dir():
                raise ValueError(f"token directory {self.token_dir} does not exist")
            RoleTokens(self.token_dir, roles).check()

    def credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials (certificate files re-read when they change, for new connections),
        or None for plaintext."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        files = _ServerCertificates(self.tls_cert, self.tls_key, self.tls_client_ca)
        return grpc.dynamic_ssl_server_credentials(
            files.load(),
            files.reload_if_changed,
            require_client_authentication=self.tls_client_ca is not None,
        )

    def interceptors(self, table: MethodRoles) -> list[grpc.aio.ServerInterceptor]:
        """The token check for a service with access table `table`; none when insecure."""
        if self.token_dir is None:
            return []
        tokens = RoleTokens(self.token_dir, roles_in(table))
        tokens.check()
        return [TokenInterceptor(tokens, table)]

    def describe(self) -> str:
        """One line for the start-up log."""
        transport = "plaintext"
        if self.tls_cert is not None:
            transport = "mutual TLS" if self.tls_client_ca is not None else "TLS"
        if self.token_dir is None:
            return f"INSECURE: no authentication, any caller is accepted ({transport})"
        return f"bearer tokens from {self.token_dir} ({transport})"


class _ServerCertificates:
    def __init__(self, cert: Path, key: Path, client_ca: Path | None) -> None:
        self._paths = [p for p in (cert, key, client_ca) if p is not None]
        self._cert, self._key, self._client_ca = cert, key, client_ca
        self._signature = self._stat()

    def _stat(self) -> tuple[tuple[int, int, int], ...]:
        stats = [os.stat(p) for p in self._paths]
        return tuple((s.st_ino, s.st_size, s.st_mtime_ns) for s in stats)

    def load(self) -> Any:
        client_ca = _read(self._client_ca) if self._client_ca is not None else None
        return grpc.ssl_server_certificate_configuration(
            [(_read(self._key), _read(self._cert))], root_certificates=client_ca
        )

    def reload_if_changed(self) -> Any:
        """Called by gRPC before each handshake: a new configuration when a file changed."""
        try:
            signature = self._stat()
            if signature == self._signature:
                return None
            configuration = self.load()
        except OSError as e:
            log.error("TLS files unreadable, keeping the loaded ones: %s", describe_error(e))
            return None
        self._signature = signature
        log.info("TLS certificate files changed: loaded them for new connections")
        return configuration


Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]
_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}
_LOG_EVERY_S = 10.0


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call before its handler runs: UNAUTHENTICATED without a valid token,
    PERMISSION_DENIED when the token's role may not call the method (or the method is not in
    the table). Calls to `OPEN_SERVICES` pass."""

    def __init__(self, tokens: RoleTokens, table: MethodRoles) -> None:
        self.tokens = tokens
        self.table = table
        self._logged: dict[tuple[grpc.StatusCode, str], float] = {}

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method
        if method.split("/")[1:2] and method.split("/")[1] in OPEN_SERVICES:
            return await continuation(handler_call_details)
        token = bearer_token(handler_call_details.invocation_metadata or ())
        role = self.tokens.role_of(token) if token is not None else None
        if role is None:
            reason = "no bearer token" if token is None else "the bearer token is not valid"
            return self._refuse(
                await continuation(handler_call_details),
                grpc.StatusCode.UNAUTHENTICATED,
                method,
                f"{reason}: send 'authorization: Bearer <token>' with a role's token",
            )
        allowed = self.table.get(method, frozenset())
        if role not in allowed:
            roles = ", ".join(sorted(r.value for r in allowed)) or "no role"
            return self._refuse(
                await continuation(handler_call_details),
                grpc.StatusCode.PERMISSION_DENIED,
                method,
                f"the {role.value} role may not call {method} (allowed: {roles})",
            )
        return await continuation(handler_call_details)

    def _refuse(
        self,
        handler: grpc.RpcMethodHandler | None,
        code: grpc.StatusCode,
        method: str,
        message: str,
    ) -> grpc.RpcMethodHandler:
        now = time.monotonic()
        if now - self._logged.get((code, method), -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._logged[(code, method)] = now
            log.warning("refused %s: %s (%s)", method, code.name, message)

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(code, message)

        kind = (False, False)
        if handler is not None:
            kind = (handler.request_streaming, handler.response_streaming)
        return _HANDLER_KINDS[kind](refuse)


# -- client side ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ClientAuth:
    """How a client reaches a service: the token file of its role, or `insecure` (no token)
    for a service that runs without authentication (exactly one of the two); TLS when
    `tls_ca` is given, with a client certificate (mutual TLS) when `tls_cert` and `tls_key`
    are."""

    token_file: Path | None = None
    """The role's token; re-read when the file changes."""
    tls_ca: Path | None = None
    """PEM CA bundle that signed the server's certificate; given: TLS, else plaintext."""
    tls_cert: Path | None = None
    """PEM client certificate chain, for a server that requires mutual TLS."""
    tls_key: Path | None = None
    """PEM private key of `tls_cert`."""
    insecure: bool = False
    """Send no token (the service runs with --insecure)."""

    def __post_init__(self) -> None:
        if (self.token_file is None) == (not self.insecure):
            raise ValueError(
                "a client needs its role's token file, or insecure mode explicitly; got "
                f"token_file={self.token_file}, insecure={self.insecure}"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(
                "a client certificate needs its key; got "
                f"tls_cert={self.tls_cert}, tls_key={self.tls_key}"
            )
        if self.tls_cert is not None and self.tls_ca is None:
            raise ValueError(
                f"a client certificate ({self.tls_cert}) needs TLS: give tls_ca, the CA "
                "that signed the server's certificate"
            )

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS channel credentials (files read now), or None for plaintext."""
        if self.tls_ca is None:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca),
            private_key=_read(self.tls_key) if self.tls_key is not None else None,
            certificate_chain=_read(self.tls_cert) if self.tls_cert is not None else None,
        )


def open_channel(
    target: str, auth: ClientAuth, options: Sequence[tuple[str, Any]] = (), *, bearer: bool = True
) -> grpc.Channel:
    """A blocking channel to `target` that sends `auth`'s token with every call; with
    `bearer=False` it does not, and the caller passes `call_metadata(auth)()` as each call's
    metadata instead, which spares each call gRPC's Python interceptor layer."""
    credentials = auth.credentials()
    if credentials is None:
        channel = grpc.insecure_channel(target, options=list(options))
    else:
        channel = grpc.secure_channel(target, credentials, options=list(options))
    if auth.token_file is None or not bearer:
        return channel
    return grpc.intercept_channel(channel, sync_interceptor(TokenFile(auth.token_file)))


def call_metadata(auth: ClientAuth) -> Callable[[], tuple[tuple[str, str], ...]]:
    """Each call's metadata for a channel opened with `bearer=False`: `auth`'s current token
    (re-read when its file changes), none without a token file."""
    if auth.token_file is None:
        return tuple
    token = TokenFile(auth.token_file)
    return lambda: bearer_metadata(token)


def open_aio_channel(
    target: str, auth: ClientAuth, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """The grpc.aio twin of `open_channel`."""
    interceptors: list[grpc.aio.ClientInterceptor] = []
    if auth.token_file is not None:
        interceptors = aio_interceptors(TokenFile(auth.token_file))
    credentials = auth.credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors)
    return grpc.aio.secure_channel(
        target, credentials, options=list(options), interceptors=interceptors
    )


@dataclass(frozen=True)
class TokenDir:
    """A directory of role tokens as the services read it (``--auth-token-dir``), and the
    settings of each role's clients: what a local stack, a benchmark or a test sets up."""

    directory: Path

    @classmethod
    def create(cls, directory: Path) -> TokenDir:
        """A fresh random token for every role, written into `directory` (mode 0700, files
        0600)."""
        return cls(write_token_dir(directory))

    def file(self, role: Role) -> Path:
        return self.directory / role.value

    def client(self, role: Role) -> ClientAuth:
        return ClientAuth(token_file=self.file(role))

    def server_args(self) -> list[str]:
        """A service's flags: callers must present a role's token."""
        return ["--auth-token-dir", str(self.directory)]

    def publisher_args(self, sidecar: str) -> list[str]:
        """trainer-svc's flags to publish to the sidecar at `sidecar` as the trainer role."""
        return ["--sidecar", sidecar, "--sidecar-token-file", str(self.file(Role.TRAINER))]
