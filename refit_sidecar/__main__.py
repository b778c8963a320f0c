"""``refit-sidecar`` / ``python -m refit_sidecar``: parse the config, serve until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging

from refit_sidecar.service.cli import SidecarConfig, parse_config
from refit_sidecar.service.server import create_server
from trainer_refit.serving import wait_for_stop_signal, write_port_file

log = logging.getLogger("refit_sidecar")


async def serve(config: SidecarConfig) -> None:
    running = await create_server(config)
    log.info("refit sidecar serving gRPC on %s:%d", config.host, running.port)
    level = logging.WARNING if config.auth.insecure else logging.INFO
    log.log(level, "authentication: %s", config.auth.describe())
    write_port_file(config.port_file, running.port)
    received = await wait_for_stop_signal()
    log.info("shutting down (%s)", received.name)
    await running.stop(config.grace_seconds)


def main(argv: list[str] | None = None) -> None:
    config, log_level = parse_config(argv)
    logging.basicConfig(level=log_level, format="%(asctime)s [sidecar] %(levelname)s %(message)s")
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
