"""The chart lints, renders and validates against the Kubernetes API schemas, for the default values
and every example value set; the rendered objects have the topology the design asks for."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
from chart_harness import (
    CHART_DIR,
    GPU_RESOURCE,
    LWS_KIND,
    NAMESPACE,
    Rendered,
    load_value_set,
    pod_templates,
    render,
    value_set_names,
)

VALUE_SETS = value_set_names()
MIN_KUBERNETES = "1.29"  # Chart.yaml kubeVersion: native sidecars, StatefulSet pod-index label
LATEST_KUBERNETES = kubernetes_validate.latest_version()
LWS_SCHEMA = json.loads((Path(__file__).parent / "schemas" / "leaderworkerset-v1.json").read_text())

RenderedSet = Callable[[str], Rendered]


def test_example_value_sets_cover_the_required_shapes() -> None:
    assert {
        "default",
        "dev-single-gpu",
        "multinode-tp-pp-rdma",
        "vllm-only",
        "leaderworkerset",
    } <= set(VALUE_SETS)


def test_chart_metadata() -> None:
    with helm.Chart.load(CHART_DIR) as chart:
        meta = chart.metadata
        assert chart.schema is not None
    assert meta["apiVersion"] == "v2"
    assert meta["kubeVersion"] == ">=1.29.0-0"


@pytest.mark.parametrize("name", VALUE_SETS)
def test_lint_is_clean(name: str) -> None:
    report = helm.lint(CHART_DIR, load_value_set(name), strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert not problems, problems
    assert not report["errors"]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_renders_notes(rendered_set: RenderedSet, name: str) -> None:
    rendered = rendered_set(name)
    assert f'release "rl" in namespace "{NAMESPACE}"' in rendered.notes
    assert rendered.manifests


def _validate(manifest: dict[str, Any], version: str) -> None:
    if manifest["kind"] == LWS_KIND:
        # Not a built-in kind: its own fields against the LWS CRD schema, its pod templates as
        # core/v1 PodTemplateSpecs of that Kubernetes version.
        jsonschema.Draft202012Validator(LWS_SCHEMA).validate(manifest)
        lwt = manifest["spec"]["leaderWorkerTemplate"]
        for key in ("leaderTemplate", "workerTemplate"):
            wrapped = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": f"{manifest['metadata']['name']}-{key.lower()}"},
                "template": lwt[key],
            }
            kubernetes_validate.validate(wrapped, version, strict=True)
    else:
        kubernetes_validate.validate(manifest, version, strict=True)


@pytest.mark.parametrize("version", [MIN_KUBERNETES, LATEST_KUBERNETES])
@pytest.mark.parametrize("name", VALUE_SETS)
def test_manifests_validate(rendered_set: RenderedSet, name: str, version: str) -> None:
    for manifest in rendered_set(name).manifests:
        try:
            _validate(manifest, version)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(
                f"{manifest['kind']}/{manifest['metadata']['name']}: {where}: {exc.message}"
            )


DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def test_names_fit_kubernetes_limits_with_the_longest_release_name(chart: helm.Chart) -> None:
    longest = "r" * 53  # Helm's limit on release names
    for name in ("default", "leaderworkerset"):
        rendered = render(chart, load_value_set(name), release=longest)
        for m in rendered.manifests:
            obj = m["metadata"]["name"]
            assert DNS_LABEL.match(obj) and len(obj) <= 63, obj
            if m["kind"] in ("StatefulSet", LWS_KIND):
                # Pods get controller-revision-hash = <name>-<hash of up to 10 characters>.
                assert len(obj) <= 52, obj
            for value in m["metadata"].get("labels", {}).values():
                assert len(str(value)) <= 63, value
        for pod in pod_templates(rendered):
            for c in [*pod.spec.get("initContainers", []), *pod.spec["containers"]]:
                for port in c.get("ports", []):
                    assert len(port["name"]) <= 15, port


def _trainer_pods(rendered: Rendered) -> list[Any]:
    return [p for p in pod_templates(rendered) if p.role is not None]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_sidecar_runs_only_in_the_rank0_pod(rendered_set: RenderedSet, name: str) -> None:
    rendered = rendered_set(name)
    values = _values(name)
    for pod in _trainer_pods(rendered):
        init = pod.spec.get("initContainers", [])
        if pod.role == "head" and values["sidecar"]["enabled"]:
            (sidecar,) = init
            assert sidecar["name"] == "refit-sidecar"
            assert sidecar["restartPolicy"] == "Always"  # a native sidecar
            assert {"startupProbe", "readinessProbe", "livenessProbe"} <= sidecar.keys()
            assert pod.spec.get("hostNetwork") is not True and pod.spec.get("hostIPC") is not True
            assert _mount_of(sidecar, "/dev/shm") == _mount_of(pod.container("trainer"), "/dev/shm")
        else:
            assert not init, f"{pod.owner['metadata']['name']} ({pod.role}) runs {init}"


def _mount_of(container: dict[str, Any], path: str) -> str:
    (name,) = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == path]
    return str(name)


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("name", VALUE_SETS)
def test_services_address_the_right_pods(rendered_set: RenderedSet, name: str) -> None:
    rendered = rendered_set(name)
    pods = list(pod_templates(rendered))
    services = {
        s["metadata"]["name"].removeprefix("rl-trainer-refit-"): s
        for s in rendered.of_kind("Service")
    }
    values = _values(name)
    expected = set()
    if values["trainer"]["enabled"]:
        expected |= {"trainer"} | ({"sidecar"} if values["sidecar"]["enabled"] else set())
        if not values["trainer"]["leaderWorkerSet"]["enabled"]:
            expected.add("trainer-headless")
    if values["vllm"]["enabled"]:
        expected.add("vllm")
    assert set(services) == expected
    for key, svc in services.items():
        selected = {p.role or "vllm" for p in pods if _selects(svc["spec"]["selector"], p.labels)}
        want = {"trainer": {"head"}, "sidecar": {"head"}, "vllm": {"vllm"}}.get(key)
        if key == "trainer-headless":
            assert svc["spec"]["clusterIP"] == "None"
            assert svc["spec"]["publishNotReadyAddresses"] is True
            want = {"head", "worker"} if values["trainer"]["nodes"] > 1 else {"head"}
        assert selected == want, f"Service {key} selects {selected}"


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_pod_has_a_memory_backed_dev_shm(rendered_set: RenderedSet, name: str) -> None:
    for pod in pod_templates(rendered_set(name)):
        volumes = {v["name"]: v for v in pod.spec["volumes"]}
        for c in [*pod.spec.get("initContainers", []), *pod.spec["containers"]]:
            assert volumes[_mount_of(c, "/dev/shm")]["emptyDir"]["medium"] == "Memory"


@pytest.mark.parametrize("name", VALUE_SETS)
def test_accelerator_resources_and_rdma_environment(rendered_set: RenderedSet, name: str) -> None:
    values = _values(name)
    rdma = values["rdma"]
    for pod in pod_templates(rendered_set(name)):
        main = pod.spec["containers"][0]
        limits, requests = main["resources"]["limits"], main["resources"]["requests"]
        want = (
            values["trainer"]["gpusPerNode"]
            if pod.role
            else values["vllm"]["tensorParallelSize"] * values["vllm"]["pipelineParallelSize"]
        )
        assert limits[GPU_RESOURCE] == requests[GPU_RESOURCE] == want
        env = {e["name"] for e in main.get("env", [])}
        if rdma["enabled"]:
            assert limits[rdma["resourceName"]] == rdma["resourceCount"]
            assert "IPC_LOCK" in main["securityContext"]["capabilities"]["add"]
            assert {"NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "UCX_TLS"} <= env
        else:
            assert not [r for r in limits if r.startswith("rdma/")]
            # UCX_TCP_PORT_RANGE is the NIXL port range, set with or without RDMA.
            nccl_ucx = {e for e in env if e.startswith(("NCCL_", "UCX_"))}
            assert nccl_ucx == {"UCX_TCP_PORT_RANGE"}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_pods_roll_when_the_config_changes(rendered_set: RenderedSet, name: str) -> None:
    for pod in pod_templates(rendered_set(name)):
        assert re.fullmatch(
            r"[0-9a-f]{64}", pod.template["metadata"]["annotations"]["checksum/config"]
        )


def test_workers_statefulset_ordinals_are_the_node_ranks(rendered_set: RenderedSet) -> None:
    rendered = rendered_set("multinode-tp-pp-rdma")
    head = rendered.one("StatefulSet", "-trainer-head")
    workers = rendered.one("StatefulSet", "-trainer-worker")
    assert head["spec"]["replicas"] == 1
    assert workers["spec"]["ordinals"]["start"] == 1
    assert workers["spec"]["replicas"] == _values("multinode-tp-pp-rdma")["trainer"]["nodes"] - 1
    for sts in (head, workers):
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        assert sts["spec"]["serviceName"].endswith("-trainer-headless")


def test_leaderworkerset_group(rendered_set: RenderedSet) -> None:
    rendered = rendered_set("leaderworkerset")
    assert not rendered.of_kind("StatefulSet")
    lws = rendered.one(LWS_KIND)
    assert lws["spec"]["replicas"] == 1
    assert (
        lws["spec"]["startupPolicy"] == "LeaderCreated"
    )  # rank 0 is ready only after the rendezvous
    assert (
        lws["spec"]["leaderWorkerTemplate"]["size"]
        == _values("leaderworkerset")["trainer"]["nodes"]
    )


def test_vllm_only_deploys_no_trainer(rendered_set: RenderedSet) -> None:
    rendered = rendered_set("vllm-only")
    kinds = sorted(m["kind"] for m in rendered.manifests)
    assert kinds == ["ConfigMap", "Deployment", "NetworkPolicy", "Service"]


def test_values_schema_is_valid_draft07() -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    for name in VALUE_SETS:
        jsonschema.Draft7Validator(schema).validate(_values(name))


def _without_secret_data(manifests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**m, "data": sorted(m["data"])} if m["kind"] == "Secret" else m for m in manifests]


@functools.cache
def _values(name: str) -> dict[str, Any]:
    """The values a release of this value set computes (chart defaults coalesced with the set)."""
    with helm.Chart.load(CHART_DIR) as chart:
        return chart.merge_values(load_value_set(name))


def test_packaged_chart_renders_the_same(tmp_path: Path, rendered_set: RenderedSet) -> None:
    archive = helm.package(CHART_DIR, destination=tmp_path)
    with helm.Chart.load(archive) as packaged:
        # The generated tokens differ between renders (no cluster to look the Secret up in).
        assert _without_secret_data(render(packaged, None).manifests) == _without_secret_data(
            rendered_set("default").manifests
        )
        assert {f["name"] for f in packaged.files} >= {"README.md", "ci/vllm-only-values.yaml"}
