"""The trainer's health entry for refit publication: ``trainer_refit.v1.RefitPublication`` is
SERVING while the refit sidecar answers and the last slot reservation or report of this rank
succeeded, NOT_SERVING otherwise (with the reason logged once per change). The overall entry
("") is unaffected: training goes on; a FinishTrainStep that cannot publish is refused, with
its step left open."""

from __future__ import annotations

import asyncio
import logging

from grpc_health.v1 import health, health_pb2

from trainer_svc.runtime.publication import Publisher

log = logging.getLogger(__name__)

SERVICE_NAME = "trainer_refit.v1.RefitPublication"
_PERIOD_S = 1.0


async def watch_publication(servicer: health.aio.HealthServicer, publisher: Publisher) -> None:
    """Runs until cancelled, updating the entry every second."""
    reported: str | None = ""
    while True:
        await asyncio.to_thread(publisher.check_sidecar)
        problem = publisher.health_problem
        if problem != reported:
            if problem is None:
                log.info("refit publication: serving")
            else:
                log.warning("refit publication not serving: %s", problem)
            status = health_pb2.HealthCheckResponse.NOT_SERVING
            if problem is None:
                status = health_pb2.HealthCheckResponse.SERVING
            await servicer.set(SERVICE_NAME, status)
            reported = problem
        await asyncio.sleep(_PERIOD_S)
