"""Credentials for the services the tests start: a token directory (one file per role, as
the services read it) with the matching client settings, and where TLS files are
(`certs.make_tls_files` writes them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainer_refit.auth import TokenDir

Tokens = TokenDir
"""The tests' name for a token directory and its clients."""


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of one CA and the server and client certificates it signed."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
