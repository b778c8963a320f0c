"""Credentials for the services the tests start: a token directory (one file per role, as
the services read it) with the matching client settings, and where TLS files are
(`certs.make_tls_files` writes them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainer_refit.auth import ClientAuth, Role, write_token_dir


@dataclass(frozen=True)
class Tokens:
    directory: Path

    @classmethod
    def create(cls, directory: Path) -> Tokens:
        """A fresh random token for every role, written into `directory`."""
        return cls(write_token_dir(directory))

    def file(self, role: Role) -> Path:
        return self.directory / role.value

    def client(self, role: Role) -> ClientAuth:
        return ClientAuth(token_file=self.file(role))

    def server_args(self) -> list[str]:
        return ["--auth-token-dir", str(self.directory)]


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of one CA and the server and client certificates it signed."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
