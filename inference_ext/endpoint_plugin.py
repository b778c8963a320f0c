"""`trainer_refit` as a vLLM endpoint plugin (``vllm.endpoint_plugins`` entry point in
pyproject.toml): in a ``vllm serve`` API server it starts auto-refit when the engine's
``--additional-config`` asks for it, and serves

- ``GET /trainer_refit/ready``: 200 once a version is installed and the engine is within
  ``max_staleness`` of the newest, else 503 with the reason (a readiness probe);
- ``GET /trainer_refit/status``: the follower's state (installed and newest version, last
  error, recent switches with their prefetch time and generation stall).

vLLM loads endpoint plugins only when ``VLLM_PLUGINS`` names them, and ``VLLM_PLUGINS`` is an
allow-list for every plugin group: set ``VLLM_PLUGINS=trainer_refit`` (plus any other plugin the
deployment uses). Auto-refit drives the workers through `RefitWorkerExtension`, so the engine
needs ``--worker-extension-cls inference_ext.RefitWorkerExtension``. With several API server
processes the first one follows.
"""

from __future__ import annotations

import logging
from argparse import Namespace
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from inference_ext.auto_config import AutoRefitConfig
from inference_ext.auto_refit import AutoRefit
from inference_ext.plugin import BACKEND
from inference_ext.worker_refit import additional_config_target

log = logging.getLogger(__name__)

EXTENSION = "inference_ext.RefitWorkerExtension"
_STATE = "trainer_refit_follower"

router = APIRouter()


def _follower(request: Request) -> AutoRefit | None:
    return getattr(request.app.state, _STATE, None)


@router.get("/trainer_refit/ready")
async def ready(request: Request) -> JSONResponse:
    follower = _follower(request)
    if follower is None:
        body = {"ready": False, "reason": "auto-refit is off in this server"}
        return JSONResponse(body, status_code=HTTPStatus.SERVICE_UNAVAILABLE)
    ok, reason = follower.readiness()
    body = {"ready": ok, "reason": reason, "installed_version": follower.installed}
    return JSONResponse(body, status_code=HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE)


@router.get("/trainer_refit/status")
async def status(request: Request) -> JSONResponse:
    follower = _follower(request)
    if follower is None:
        return JSONResponse({"auto_refit": False})
    return JSONResponse({"auto_refit": True, **follower.status()})


def auto_refit_settings(vllm_config: Any) -> tuple[Any, AutoRefitConfig] | None:
    """The refit target and auto-refit settings of an engine's ``--additional-config``, None
    when it does not ask for auto-refit; ValueError naming what is wrong with them."""
    section = (vllm_config.additional_config or {}).get("refit") or {}
    auto = AutoRefitConfig.from_value(section.get("auto"))
    if auto is None:
        return None
    target = additional_config_target(vllm_config)
    if target is None:
        raise ValueError('refit "auto" needs the sidecar\'s address: "refit": {"sidecar": ...}')
    extension = vllm_config.parallel_config.worker_extension_cls
    if extension != EXTENSION:
        raise ValueError(f"auto-refit needs --worker-extension-cls {EXTENSION}, got {extension!r}")
    if vllm_config.parallel_config.data_parallel_size != 1:
        raise ValueError("auto-refit follows one engine: run one vllm serve per data-parallel rank")
    return target, auto


class TrainerRefitEndpoints:
    """The plugin object vLLM instantiates (`vllm.plugins.endpoint_plugins.EndpointPlugin`)."""

    name = BACKEND
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        setattr(state, _STATE, None)
        if engine_client is None:
            return
        vllm_config = engine_client.vllm_config
        settings = auto_refit_settings(vllm_config)  # a bad setting stops the server here
        if settings is None:
            return
        if vllm_config.parallel_config._api_process_rank > 0:
            return  # the first API server process follows for the engine
        target, auto = settings
        follower = AutoRefit(engine_client, target, auto)
        follower.start()
        setattr(state, _STATE, follower)
