"""The authentication flags both services share, and their mapping to `ServerAuth` /
`ClientAuth`, so trainer-svc and refit-sidecar spell and check them the same way:

    --auth-token-dir DIR --tls-cert PATH --tls-key PATH --tls-client-ca PATH --insecure

and, for a service that is itself a client of another (trainer-svc of the sidecar), the
client's flags under a prefix: ``--sidecar-token-file``, ``--sidecar-tls-ca``,
``--sidecar-tls-cert``, ``--sidecar-tls-key``.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

from trainer_refit.auth import ClientAuth, Role, ServerAuth


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "authentication (docs/security.md); --auth-token-dir or --insecure is required"
    )
    group.add_argument(
        "--auth-token-dir",
        type=Path,
        default=None,
        help="directory of bearer tokens, one file per role named by the role "
        "(orchestrator, trainer, receiver); a changed file is read again",
    )
    group.add_argument(
        "--tls-cert", type=Path, default=None, help="PEM server certificate chain (TLS)"
    )
    group.add_argument("--tls-key", type=Path, default=None, help="PEM key of --tls-cert")
    group.add_argument(
        "--tls-client-ca",
        type=Path,
        default=None,
        help="PEM CA bundle; clients must present a certificate it signed (mutual TLS)",
    )
    group.add_argument(
        "--insecure",
        action="store_true",
        help="accept every caller without a token (only on a trusted network)",
    )


def server_auth(args: argparse.Namespace, roles: Iterable[Role]) -> ServerAuth:
    """The parsed server flags as a `ServerAuth` whose files (the token files of `roles`,
    the TLS files) are checked now; ValueError naming the flags otherwise."""
    if args.auth_token_dir is None and not args.insecure:
        raise ValueError(
            "pass --auth-token-dir DIR (a bearer token file per role) to authenticate callers, "
            "or --insecure to accept every caller"
        )
    if args.auth_token_dir is not None and args.insecure:
        raise ValueError("--auth-token-dir and --insecure exclude each other")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_client_ca is not None and args.tls_cert is None:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
    auth = ServerAuth(
        token_dir=args.auth_token_dir,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        insecure=args.insecure,
    )
    auth.check(roles)
    return auth


def add_client_flags(parser: argparse.ArgumentParser, prefix: str, role: Role) -> None:
    """``--{prefix}-token-file`` (the token of `role`) and ``--{prefix}-tls-{ca,cert,key}``."""
    group = parser.add_argument_group(f"authentication at the {prefix} (docs/security.md)")
    group.add_argument(
        f"--{prefix}-token-file",
        type=Path,
        default=None,
        help=f"file holding the {role.value} role's bearer token for the {prefix}; "
        "required unless --insecure",
    )
    group.add_argument(
        f"--{prefix}-tls-ca",
        type=Path,
        default=None,
        help=f"PEM CA bundle of the {prefix}'s certificate: connect with TLS",
    )
    group.add_argument(
        f"--{prefix}-tls-cert",
        type=Path,
        default=None,
        help=f"PEM client certificate, for a {prefix} that requires mutual TLS",
    )
    group.add_argument(f"--{prefix}-tls-key", type=Path, default=None, help="its PEM key")


def client_auth(args: argparse.Namespace, prefix: str, *, used: bool) -> ClientAuth:
    """The parsed ``--{prefix}-*`` flags as a `ClientAuth`. Without a token file the client
    sends no token, which only ``--insecure`` allows. `used`: the client is configured (else
    its flags are refused and an unused insecure ClientAuth returned)."""
    attr = prefix.replace("-", "_")
    token_file, ca, cert, key = (
        getattr(args, f"{attr}_{name}") for name in ("token_file", "tls_ca", "tls_cert", "tls_key")
    )
    given = [
        f"--{prefix}-{name}"
        for name, value in (("token-file", token_file), ("tls-ca", ca), ("tls-cert", cert))
        if value is not None
    ]
    if not used:
        if given:
            raise ValueError(f"{', '.join(given)} without --{prefix}")
        return ClientAuth(insecure=True)
    if token_file is None and not args.insecure:
        raise ValueError(
            f"--{prefix} needs --{prefix}-token-file FILE (its bearer token), unless --insecure"
        )
    if (cert is None) != (key is None):
        raise ValueError(f"--{prefix}-tls-cert and --{prefix}-tls-key go together")
    if cert is not None and ca is None:
        raise ValueError(f"--{prefix}-tls-cert needs --{prefix}-tls-ca")
    for flag, path in ((f"--{prefix}-token-file", token_file), (f"--{prefix}-tls-ca", ca)):
        if path is not None and not path.is_file():
            raise ValueError(f"{flag}: {path} does not exist")
    return ClientAuth(
        token_file=token_file,
        tls_ca=ca,
        tls_cert=cert,
        tls_key=key,
        insecure=token_file is None,
    )
