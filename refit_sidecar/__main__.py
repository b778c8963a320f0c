"""``refit-sidecar`` / ``python -m refit_sidecar``: parse the config, serve until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal

from refit_sidecar.cli import SidecarConfig, parse_config
from refit_sidecar.server import create_server

log = logging.getLogger("refit_sidecar")


async def serve(config: SidecarConfig) -> None:
    server, port, health = await create_server(config)
    log.info("refit sidecar serving gRPC on %s:%d", config.host, port)
    if config.port_file is not None:
        tmp = config.port_file.with_suffix(".tmp")
        tmp.write_text(str(port))
        tmp.replace(config.port_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await health.enter_graceful_shutdown()
    await server.stop(config.grace_seconds)


def main(argv: list[str] | None = None) -> None:
    config, log_level = parse_config(argv)
    logging.basicConfig(level=log_level, format="%(asctime)s [sidecar] %(levelname)s %(message)s")
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
