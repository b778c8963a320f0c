"""Per-call cost of bearer authentication on the control plane: the same refit-sidecar
(in-process, 127.0.0.1, port 0) with a token directory and with --insecure, the same blocking
SidecarClient, GetLatestVersion timed call by call; modes alternate in blocks. "token-only":
the client sends its token to the insecure server (the client interceptor's share).
Also the interceptor's own work timed alone: the client's token read and the server's role lookup.

    python -m benchmarks.auth_cost --calls 200 --blocks 20
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
import timeit
from pathlib import Path

from refit_sidecar.service.cli import SidecarConfig
from refit_sidecar.service.client import SidecarClient
from refit_sidecar.service.server import create_server
from trainer_refit.auth import ClientAuth, Role, RoleTokens, ServerAuth, TokenDir
from trainer_refit.bearer import bearer_token
from trainer_refit.tokens import TokenFile


def measure(calls: int, blocks: int) -> dict[str, float]:
    """Median microseconds per call by mode; prints the table (BENCHMARKS.md, auth_cost)."""
    tokens = TokenDir.create(Path(tempfile.mkdtemp()) / "tokens")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servers, clients = {}, {}
    for mode, auth, client_auth in (
        ("auth", ServerAuth(token_dir=tokens.directory), tokens.client(Role.RECEIVER)),
        ("token-only", ServerAuth(insecure=True), tokens.client(Role.RECEIVER)),
        ("insecure", ServerAuth(insecure=True), ClientAuth(insecure=True)),
    ):
        config = SidecarConfig(host="127.0.0.1", port=0, auth=auth)
        servers[mode] = asyncio.run_coroutine_threadsafe(create_server(config), loop).result()
        clients[mode] = SidecarClient(f"127.0.0.1:{servers[mode].port}", 10, auth=client_auth)
    us: dict[str, list[float]] = {mode: [] for mode in clients}
    for client in clients.values():  # warm-up
        for _ in range(calls):
            client.latest_version()
    for block in range(blocks):
        order = list(clients) if block % 2 == 0 else list(reversed(clients))  # ABC CBA ...
        for mode in order:
            client = clients[mode]
            for _ in range(calls):
                start = time.perf_counter_ns()
                client.latest_version()
                us[mode].append((time.perf_counter_ns() - start) / 1e3)
    medians = {mode: statistics.median(v) for mode, v in us.items()}
    for mode, v in us.items():
        q = statistics.quantiles(v, n=10)
        print(
            f"{mode:<9} GetLatestVersion round trip: median {medians[mode]:.1f} us, "
            f"p10 {q[0]:.1f}, p90 {q[-1]:.1f} ({len(v)} calls)"
        )
    base = medians["insecure"]
    print(
        f"auth adds {medians['auth'] - base:+.1f} us per call ({medians['auth'] / base:.3f}x): "
        f"client interceptor {medians['token-only'] - base:+.1f} us, "
        f"server interceptor {medians['auth'] - medians['token-only']:+.1f} us"
    )
    token_file = TokenFile(tokens.file(Role.RECEIVER))
    role_tokens = RoleTokens(tokens.directory, [Role.RECEIVER, Role.TRAINER])
    token = token_file.read()[0]
    metadata = (("authorization", f"Bearer {token}"),)
    n = 100 * calls  # 20,000 checks at the default 200 calls per block

    def server_check() -> object:
        presented = bearer_token(metadata)
        assert presented is not None
        return role_tokens.role_of(presented)

    for name, fn in (
        ("client: token file read (stat, cached)", token_file.read),
        ("server: bearer_token + role_of", server_check),
    ):
        print(f"{name}: {1e6 * min(timeit.repeat(fn, number=n, repeat=5)) / n:.1f} us")
    for mode, client in clients.items():
        client.close()
        asyncio.run_coroutine_threadsafe(servers[mode].stop(0), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    return medians


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per block")
    parser.add_argument("--blocks", type=int, default=20, help="timed blocks per mode")
    args = parser.parse_args(argv)
    measure(args.calls, args.blocks)


if __name__ == "__main__":
    main(sys.argv[1:])
