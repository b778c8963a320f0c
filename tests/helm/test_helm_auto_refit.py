"""The receivers' auto-refit values: vllm.autoRefit, vllm.autoRefitOptions, the readiness gate on
the installed version, and VLLM_PLUGINS, as rendered into the vLLM Deployment."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

import helm_python as helm
import pytest
from chart_harness import (
    AUTO_REFIT_FIELDS,
    CHART_DIR,
    PodTemplate,
    Rendered,
    container_env,
    pod_templates,
    render,
)

from inference_ext.auto_config import AutoRefitConfig, FollowPolicy, PauseMode

READY_PATH = "/trainer_refit/ready"


def _receiver(rendered: Rendered) -> tuple[PodTemplate, dict[str, Any]]:
    (pod,) = [p for p in pod_templates(rendered) if p.role is None]
    return pod, pod.container("vllm")


def _refit(chart: helm.Chart, vllm: dict[str, Any]) -> dict[str, Any]:
    """The refit section of the receivers' --additional-config."""
    _, container = _receiver(render(chart, {"vllm": vllm}))
    (flag,) = [a for a in container["args"] if a.startswith("--additional-config=")]
    refit: dict[str, Any] = json.loads(flag.split("=", 1)[1])["refit"]
    return refit


def _schema_options() -> dict[str, Any]:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    options: dict[str, Any] = schema["properties"]["vllm"]["properties"]["autoRefitOptions"]
    return options


def test_auto_refit_is_on_by_default(chart: helm.Chart) -> None:
    assert chart.values["vllm"]["autoRefit"] is True
    assert _refit(chart, {})["auto"] is True
    assert AutoRefitConfig.from_value(True) == AutoRefitConfig()


def test_auto_refit_off_renders_false(chart: helm.Chart) -> None:
    auto = _refit(chart, {"autoRefit": False})["auto"]
    assert auto is False
    assert AutoRefitConfig.from_value(auto) is None


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            {"policy": "every", "pauseMode": "wait", "maxStaleness": 3},
            {"policy": "every", "pause_mode": "wait", "max_staleness": 3},
        ),
        ({"maxStaleness": 0}, {"max_staleness": 0}),
        (
            {"pauseMode": "abort", "pollIntervalSeconds": 0.2, "retryIntervalSeconds": 5},
            {"pause_mode": "abort", "poll_interval_s": 0.2, "retry_interval_s": 5},
        ),
        # null means not given; nothing given is plain true.
        ({"policy": "latest", "maxStaleness": None}, {"policy": "latest"}),
        ({"maxStaleness": None}, True),
    ],
)
def test_auto_refit_options_render_as_the_auto_object(
    chart: helm.Chart, options: dict[str, Any], expected: Any
) -> None:
    auto = _refit(chart, {"autoRefitOptions": options})["auto"]
    assert auto == expected
    config = AutoRefitConfig.from_value(auto)
    given = {k: v for k, v in options.items() if v is not None}
    assert config is not None
    for key, value in given.items():
        field = getattr(config, AUTO_REFIT_FIELDS[key])
        assert getattr(field, "value", field) == value


def test_every_auto_refit_field_can_be_set(chart: helm.Chart) -> None:
    schema = _schema_options()
    samples = {
        "string": lambda p: p["enum"][-1],
        "integer": lambda p: 7,
        "number": lambda p: 1.5,
    }
    options = {}
    for key, prop in schema["properties"].items():
        kind = prop["type"] if isinstance(prop["type"], str) else prop["type"][0]
        options[key] = samples[kind](prop)
    auto = _refit(chart, {"autoRefitOptions": options})["auto"]
    assert set(auto) == {f.name for f in fields(AutoRefitConfig)}
    config = AutoRefitConfig.from_value(auto)
    assert config is not None and config.to_dict() == auto


def test_auto_refit_schema_enums_are_the_config_enums() -> None:
    properties = _schema_options()["properties"]
    assert properties["policy"]["enum"] == [p.value for p in FollowPolicy]
    assert properties["pauseMode"]["enum"] == [m.value for m in PauseMode]


@pytest.mark.parametrize("vllm", [{}, {"autoRefit": False}])
def test_default_readiness_probe_is_health(chart: helm.Chart, vllm: dict[str, Any]) -> None:
    _, container = _receiver(render(chart, {"vllm": vllm}))
    for kind in ("startup", "readiness", "liveness"):
        assert container[f"{kind}Probe"]["httpGet"] == {"path": "/health", "port": "http"}


def test_readiness_gate_probes_the_installed_version(chart: helm.Chart) -> None:
    from inference_ext.endpoint_plugin import router

    rendered = render(chart, {"vllm": {"readinessGate": {"versionInstalled": True}}})
    _, container = _receiver(rendered)
    probe = container["readinessProbe"]
    assert probe["httpGet"] == {"path": READY_PATH, "port": "http"}
    assert READY_PATH in {r.path for r in router.routes}  # type: ignore[attr-defined]
    timing = chart.values["vllm"]["probes"]["readiness"]
    assert {k: probe[k] for k in timing} == timing
    for kind in ("startup", "liveness"):  # the server is up and alive without a version
        assert container[f"{kind}Probe"]["httpGet"]["path"] == "/health"
    assert "/trainer_refit/ready" in rendered.notes


def _env(rendered: Rendered) -> list[dict[str, Any]]:
    _, container = _receiver(rendered)
    env: list[dict[str, Any]] = container["env"]
    return env


def test_vllm_plugins_names_the_package_and_extra_plugins(chart: helm.Chart) -> None:
    from inference_ext.plugin import BACKEND

    rendered = render(chart, {"vllm": {"extraPlugins": ["my_platform", BACKEND, "lora"]}})
    pod, container = _receiver(rendered)
    assert container_env(pod, container, rendered)["VLLM_PLUGINS"] == f"{BACKEND},my_platform,lora"
    assert [e["name"] for e in _env(rendered)].count("VLLM_PLUGINS") == 1


def test_extra_args_and_env_follow_the_charts(chart: helm.Chart) -> None:
    extra_env = [{"name": "VLLM_SERVER_DEV_MODE", "value": "1"}]
    rendered = render(
        chart,
        {
            "env": [{"name": "A", "value": "a"}],
            "vllm": {"extraArgs": ["--seed=3"], "env": extra_env},
        },
    )
    _, container = _receiver(rendered)
    args = container["args"]
    assert args[-1] == "--seed=3"
    assert {"--enable-scale-out", '--weight-transfer-config={"backend":"trainer_refit"}'} <= set(
        args[:-1]
    )
    names = [e["name"] for e in _env(rendered)]
    assert names[0] == "VLLM_PLUGINS" and names[-2:] == ["A", "VLLM_SERVER_DEV_MODE"]
