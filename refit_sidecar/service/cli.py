"""Command line of ``refit-sidecar``: argv -> SidecarConfig. The parser is importable for checks."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from refit_sidecar.core.tree_records import TreeConfig
from refit_sidecar.service.access import METHOD_ROLES
from refit_sidecar.service.registry import FullPolicy, RegistryConfig
from trainer_refit import auth_flags
from trainer_refit.auth import ServerAuth, roles_in


@dataclass(frozen=True, kw_only=True)
class SidecarConfig:
    host: str = "0.0.0.0"
    port: int = 50052
    """0 picks a free port; the bound port is logged and written to port_file when given."""
    port_file: Path | None = None
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    grace_seconds: float = 5.0
    auth: ServerAuth = field(default_factory=lambda: ServerAuth(insecure=True))
    """Who may call (docs/security.md). The CLI never falls back to this default: it needs
    --auth-token-dir or an explicit --insecure."""
    tree: TreeConfig = field(default_factory=TreeConfig)
    """Tree fan-out: children per source, peer registrations' TTL (docs/fanout.md)."""
    drain_timeout_s: float = 5.0
    """How long a receiver offering a new version waits for the readers of its older copy."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain timeout must be >= 0 s, got {self.drain_timeout_s}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="refit-sidecar",
        description=(
            "The refit control plane: trainer ranks publish each weights version here; "
            "receivers read manifests and lease versions while they pull them over NIXL."
        ),
    )
    parser.add_argument("--host", default=SidecarConfig.host)
    parser.add_argument("--port", type=int, default=SidecarConfig.port, help="0 picks a free port")
    parser.add_argument("--port-file", type=Path, default=None)
    auth_flags.add_server_flags(parser)
    parser.add_argument(
        "--when-all-slots-leased",
        choices=[p.value for p in FullPolicy],
        default=RegistryConfig.full_policy.value,
        help="wait (bounded by --max-wait-seconds) for a lease to end, or fail the step",
    )
    parser.add_argument("--max-wait-seconds", type=float, default=RegistryConfig.max_wait_seconds)
    parser.add_argument("--max-lease-seconds", type=float, default=RegistryConfig.max_lease_seconds)
    parser.add_argument(
        "--publish-timeout-seconds",
        type=float,
        default=RegistryConfig.publish_timeout_seconds,
        help="how long a slot reservation waits for every rank to report the previous version",
    )
    parser.add_argument(
        "--trainer-ttl-seconds",
        type=float,
        default=RegistryConfig.trainer_ttl_seconds,
        help=(
            "how long a trainer's registration lives without a renewal; while it lives, "
            "another trainer's registration is refused unless it takes over"
        ),
    )
    tree = TreeConfig()
    parser.add_argument(
        "--max-children",
        type=int,
        default=tree.max_children,
        help="receivers one receiver serving its copy feeds at a time (tree fan-out)",
    )
    parser.add_argument(
        "--max-root-children",
        type=int,
        default=tree.max_root_children,
        help="receivers one trainer rank feeds at a time: the first level of the tree",
    )
    parser.add_argument(
        "--peer-ttl-seconds",
        type=float,
        default=tree.peer_ttl_s,
        help="how long a receiver's offered copy stays a source without a renewal",
    )
    parser.add_argument(
        "--hold-parents-seconds",
        type=float,
        default=tree.hold_parents_s,
        help=(
            "how long after a version opens each receiver's parents of its previous pull are "
            "held for it, so the tree keeps its shape whatever order receivers ask in (0: off)"
        ),
    )
    parser.add_argument(
        "--drain-timeout-seconds",
        type=float,
        default=SidecarConfig.drain_timeout_s,
        help=(
            "how long a receiver offering a new version waits for the receivers still reading "
            "its copy of an older one before that copy is withdrawn"
        ),
    )
    parser.add_argument(
        "--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], default="INFO"
    )
    return parser


def parse_config(argv: Sequence[str] | None = None) -> tuple[SidecarConfig, str]:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = SidecarConfig(
            host=args.host,
            port=args.port,
            port_file=args.port_file,
            auth=auth_flags.server_auth(args, roles_in(METHOD_ROLES)),
            registry=RegistryConfig(
                full_policy=FullPolicy(args.when_all_slots_leased),
                max_wait_seconds=args.max_wait_seconds,
                max_lease_seconds=args.max_lease_seconds,
                publish_timeout_seconds=args.publish_timeout_seconds,
                trainer_ttl_seconds=args.trainer_ttl_seconds,
            ),
            tree=TreeConfig(
                max_children=args.max_children,
                max_root_children=args.max_root_children,
                peer_ttl_s=args.peer_ttl_seconds,
                hold_parents_s=args.hold_parents_seconds,
            ),
            drain_timeout_s=args.drain_timeout_seconds,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return config, args.log_level
