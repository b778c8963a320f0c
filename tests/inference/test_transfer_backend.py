"""The `trainer_refit` backend's JSON: init info (sidecar + `RefitOptions`, flat) and update
info (a version or "latest") are checked when they arrive, naming what is wrong; and the
installed package declares the vLLM plugin that registers the backend. (The backend at work
in a real `vllm serve`: test_vllm_serve.py.)"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

import pytest

from inference_ext.plugin import BACKEND, register
from inference_ext.receiver import RefitError
from inference_ext.refit_options import ReceiverAuth, RefitOptions
from inference_ext.transfer_backend import check_init, parse_init_info, parse_update_info
from inference_ext.worker_refit import RefitTarget


def test_init_info_is_the_sidecar_and_the_refit_options() -> None:
    info = parse_init_info(
        {"sidecar": "sidecar:50052", "token_file": "/run/tokens/receiver", "lease_ttl_s": 9}
    )
    assert info.target == RefitTarget(
        sidecar="sidecar:50052",
        options=RefitOptions(auth=ReceiverAuth(token_file="/run/tokens/receiver"), lease_ttl_s=9),
    )


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"token_file": "/t"}, "the sidecar address"),
        (
            {"sidecar": None, "token_file": "/t"},
            "HOST:PORT, got None",
        ),
        ({"sidecar": "s:1"}, "needs its role's token file, or insecure mode"),
        ({"sidecar": "s:1", "insecure": True, "auto": True}, r"unknown refit options \['auto'\]"),
        ({"sidecar": "s:1", "insecure": True, "pull_timeout_s": "5"}, "pull_timeout_s must be"),
        (["s:1"], "init_info must be a JSON object"),
    ],
)
def test_bad_init_info_is_refused(values: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_init_info(values)


@pytest.mark.parametrize(("version", "wanted"), [(1, 1), (42, 42), ("latest", None)])
def test_update_info_names_a_version_or_the_latest(version: int | str, wanted: int | None) -> None:
    assert parse_update_info({"version": version}).wanted == wanted


@pytest.mark.parametrize(
    "values", [{}, {"version": 0}, {"version": "3"}, {"version": True}, {"version": 1, "x": 2}]
)
def test_bad_update_info_is_refused(values: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="version"):
        parse_update_info(values)


def test_the_package_declares_the_vllm_plugin() -> None:
    (plugin,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == BACKEND]
    assert plugin.load() is register
    register()
    register()  # vLLM may run a process's plugins again; registering twice is harmless


def test_settings_fixed_at_start_cannot_be_changed() -> None:
    pinned = RefitTarget(
        sidecar="sidecar:50052", options=RefitOptions(auth=ReceiverAuth(token_file="/t"))
    )
    check_init(None, pinned)
    check_init(
        pinned,
        RefitTarget(
            sidecar="sidecar:50052", options=RefitOptions(auth=ReceiverAuth(token_file="/t"))
        ),
    )
    for other in (
        RefitTarget(
            sidecar="elsewhere:50052", options=RefitOptions(auth=ReceiverAuth(token_file="/t"))
        ),
        RefitTarget(
            sidecar="sidecar:50052",
            options=RefitOptions(auth=ReceiverAuth(token_file="/etc/passwd")),
        ),
    ):
        with pytest.raises(RefitError, match="fixed by its --additional-config"):
            check_init(pinned, other)
