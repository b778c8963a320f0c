"""Starts a real refit-sidecar process (gRPC on port 0, bearer tokens on; mutual TLS when
given certificates) for tests and stops it cleanly. `Sidecar` holds its address and
credentials: clients and stubs of either role, and the flags a trainer needs to publish to it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from refit_sidecar.service.client import SidecarClient
from tests.support.auth import TlsFiles, Tokens
from trainer_refit.auth import ClientAuth, Role, open_channel
from trainer_refit.v1 import refit_pb2_grpc


@dataclass(frozen=True)
class Sidecar:
    address: str
    """HOST:PORT."""
    tokens: Tokens
    tls: TlsFiles | None = None
    """Set: the sidecar speaks mutual TLS only."""

    def auth(self, role: Role = Role.RECEIVER) -> ClientAuth:
        """`role`'s token, and over mutual TLS the CA and client certificate."""
        if self.tls is None:
            return self.tokens.client(role)
        return ClientAuth(
            token_file=self.tokens.file(role),
            tls_ca=self.tls.ca,
            tls_cert=self.tls.client_cert,
            tls_key=self.tls.client_key,
        )

    def token_file(self, role: Role = Role.RECEIVER) -> str:
        """The role's token file as a string (what `RefitOptions.auth.token_file` takes)."""
        return str(self.tokens.file(role))

    def client(self, role: Role = Role.RECEIVER, timeout: float | None = None) -> SidecarClient:
        return SidecarClient(self.address, timeout=timeout, auth=self.auth(role))

    def channel(self, role: Role) -> grpc.Channel:
        """A channel sending `role`'s token with every call (the caller closes it)."""
        return open_channel(self.address, self.auth(role))

    def stub(self, role: Role) -> refit_pb2_grpc.RefitServiceStub:
        return refit_pb2_grpc.RefitServiceStub(self.channel(role))

    def trainer_args(self) -> list[str]:
        """trainer-svc flags that publish to this sidecar with the trainer role's token."""
        args = ["--sidecar", self.address, "--sidecar-token-file", self.token_file(Role.TRAINER)]
        if self.tls is not None:
            args += ["--sidecar-tls-ca", str(self.tls.ca)]
            args += ["--sidecar-tls-cert", str(self.tls.client_cert)]
            args += ["--sidecar-tls-key", str(self.tls.client_key)]
        return args


def start_sidecar(
    workdir: Path,
    *args: str,
    port: int = 0,
    tokens: Tokens | None = None,
    tls: TlsFiles | None = None,
    log_path: Path | None = None,
) -> tuple[subprocess.Popen, Sidecar]:
    """A refit-sidecar process on `port` (0: a free one), once it serves. Its tokens are
    `tokens` (a restarted sidecar keeps its predecessor's), else fresh ones under `workdir`;
    with `tls`, it requires mutual TLS. With `log_path`, its output goes to that file."""
    workdir.mkdir(parents=True, exist_ok=True)
    tokens = tokens or Tokens.create(workdir / "tokens")
    port_file = workdir / "sidecar-port"
    port_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "refit_sidecar", "--port", str(port), "--host", "127.0.0.1"]
    command += ["--port-file", str(port_file), *tokens.server_args(), *args]
    if tls is not None:
        command += ["--tls-cert", str(tls.server_cert), "--tls-key", str(tls.server_key)]
        command += ["--tls-client-ca", str(tls.ca)]
    if log_path is None:
        process = subprocess.Popen(command, env=os.environ)
    else:
        with log_path.open("ab") as log:  # the child keeps its own descriptor
            process = subprocess.Popen(command, env=os.environ, stdout=log, stderr=log)
    while not port_file.exists():
        assert process.poll() is None, "refit-sidecar exited early"
        time.sleep(0.05)
    return process, Sidecar(f"127.0.0.1:{port_file.read_text()}", tokens, tls)


@contextmanager
def running_sidecar(
    workdir: Path, *args: str, tls: TlsFiles | None = None, log_path: Path | None = None
) -> Iterator[Sidecar]:
    """Yields the running sidecar; asserts a clean exit on SIGTERM afterwards."""
    process, sidecar = start_sidecar(workdir, *args, tls=tls, log_path=log_path)
    try:
        yield sidecar
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
