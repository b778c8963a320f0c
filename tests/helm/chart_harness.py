"""Render helm/trainer-refit with the real Helm engine and read back what Kubernetes would run.

Torch- and vLLM-free: the tests that need those parsers import them themselves. Everything here is
offline; ``helm_python`` embeds Helm's Go engine (no helm binary, no cluster).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "trainer-refit"
CI_VALUES_DIR = CHART_DIR / "ci"
RELEASE = "rl"
NAMESPACE = "train"

GPU_RESOURCE = "nvidia.com/gpu"
POD_INDEX_FIELD = "metadata.labels['apps.kubernetes.io/pod-index']"
SAMPLE_POD_IP = "10.4.0.17"
"""What the downward API's status.podIP gives a sample pod."""
TLS_KEYS = ("tls.crt", "tls.key", "ca.crt")
"""Keys of the TLS Secret the chart reads (auth.tls.secretName)."""
LWS_KIND = "LeaderWorkerSet"
AUTO_REFIT_FIELDS = {
    "policy": "policy",
    "pauseMode": "pause_mode",
    "maxStaleness": "max_staleness",
    "pollIntervalSeconds": "poll_interval_s",
    "retryIntervalSeconds": "retry_interval_s",
}
"""vllm.autoRefitOptions keys -> the fields of refit.auto (inference_ext's AutoRefitConfig)."""


def value_set_names() -> list[str]:
    """ "default" (values.yaml alone) and every example value set under the chart's ci/."""
    return ["default", *sorted(p.name.removesuffix("-values.yaml") for p in ci_value_files())]


def ci_value_files() -> list[Path]:
    return sorted(CI_VALUES_DIR.glob("*-values.yaml"))


def load_value_set(name: str) -> dict[str, Any] | None:
    if name == "default":
        return None
    loaded: dict[str, Any] = yaml.safe_load((CI_VALUES_DIR / f"{name}-values.yaml").read_text())
    return loaded


@dataclass(frozen=True)
class Rendered:
    """A rendered release: the manifests Kubernetes would receive, and NOTES.txt."""

    manifests: list[dict[str, Any]]
    notes: str

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.manifests if m["kind"] == kind]

    def one(self, kind: str, name_suffix: str = "") -> dict[str, Any]:
        found = [m for m in self.of_kind(kind) if m["metadata"]["name"].endswith(name_suffix)]
        assert len(found) == 1, f"expected one {kind} named *{name_suffix}, got {len(found)}"
        return found[0]

    def config_data(self) -> dict[str, str]:
        data: dict[str, str] = self.one("ConfigMap", "-config").get("data") or {}
        return data


def render(chart: helm.Chart, values: dict[str, Any] | None, *, release: str = RELEASE) -> Rendered:
    """Render like `helm template` (schema validation and templates/_validate.tpl included)."""
    files = chart.render(values, name=release, namespace=NAMESPACE, is_install=True)
    manifests: list[dict[str, Any]] = []
    notes = ""
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        manifests.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return Rendered(manifests=manifests, notes=notes)


def render_error(chart: helm.Chart, values: dict[str, Any]) -> str:
    """The message with which Helm rejects the values; fails the test when it accepts them."""
    try:
        chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    except helm.HelmError as exc:
        return str(exc)
    raise AssertionError(f"Helm accepted values it should reject: {values}")


@dataclass(frozen=True)
class PodTemplate:
    """One pod template of a workload, with what the pod learns about itself at run time."""

    owner: dict[str, Any]
    template: dict[str, Any]
    pod_index: int | None
    """Sample apps.kubernetes.io/pod-index of a pod of this template (StatefulSets)."""
    injected_env: tuple[tuple[str, str], ...]
    """Environment a controller's webhook prepends to every container (LeaderWorkerSet)."""

    @property
    def labels(self) -> dict[str, str]:
        labels: dict[str, str] = self.template["metadata"]["labels"]
        return labels

    @property
    def spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = self.template["spec"]
        return spec

    @property
    def role(self) -> str | None:
        return self.labels.get("trainer-refit/role")

    def container(self, name: str) -> dict[str, Any]:
        for c in [*self.spec.get("initContainers", []), *self.spec["containers"]]:
            if c["name"] == name:
                return dict(c)
        raise AssertionError(f"no container {name} in {self.owner['metadata']['name']}")


def pod_templates(rendered: Rendered) -> Iterator[PodTemplate]:
    """Every pod template of the release, with sample identities a real pod of it would get."""
    for m in rendered.manifests:
        kind, spec = m["kind"], m.get("spec", {})
        if kind == "Deployment":
            yield PodTemplate(m, spec["template"], None, ())
        elif kind == "StatefulSet":
            start = spec.get("ordinals", {}).get("start", 0)
            yield PodTemplate(m, spec["template"], start, ())
        elif kind == LWS_KIND:
            yield from _lws_pod_templates(m)


def _lws_pod_templates(lws: dict[str, Any]) -> Iterator[PodTemplate]:
    # What the LWS pod webhook prepends to every container of group 0 (kubernetes-sigs/lws
    # pkg/utils/pod/pod_utils.go, AddLWSVariables); with subdomainPolicy Shared
    # LWS_LEADER_ADDRESS = <lws>-<group>.<subdomain = lws>.<namespace>.
    name = lws["metadata"]["name"]
    lwt = lws["spec"]["leaderWorkerTemplate"]
    size = str(lwt.get("size", 1))

    def env(worker_index: int) -> tuple[tuple[str, str], ...]:
        return (
            ("LWS_LEADER_ADDRESS", f"{name}-0.{name}.{NAMESPACE}"),
            ("LWS_GROUP_SIZE", size),
            ("LWS_WORKER_INDEX", str(worker_index)),
        )

    yield PodTemplate(lws, lwt.get("leaderTemplate") or lwt["workerTemplate"], None, env(0))
    yield PodTemplate(lws, lwt["workerTemplate"], None, env(1))


_REFERENCE = re.compile(r"\$(\$|\(([A-Za-z_][A-Za-z0-9_.\-]*)\))")


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion of command, args and env values: "$$" is a literal "$",
    a reference to a defined variable is replaced, any other reference is left as written."""

    def substitute(m: re.Match[str]) -> str:
        if m.group(1) == "$":
            return "$"
        return env.get(m.group(2), m.group(0))

    return _REFERENCE.sub(substitute, text)


def container_env(
    pod: PodTemplate, container: dict[str, Any], rendered: Rendered
) -> dict[str, str]:
    """The environment the kubelet builds for a container: envFrom first, then env in order
    (each value expanded against what precedes it); downward-API fields get sample values."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            cm = rendered.one("ConfigMap", "")
            assert cm["metadata"]["name"] == source["configMapRef"]["name"], "unknown ConfigMap"
            env.update(rendered.config_data())
        # A credentials secretRef holds the user's keys; the chart references none of them.
    entries = [{"name": k, "value": v} for k, v in pod.injected_env] + container.get("env", [])
    for entry in entries:
        if "value" in entry:
            env[entry["name"]] = expand(str(entry["value"]), env)
        else:
            env[entry["name"]] = _downward_sample(pod, entry["valueFrom"])
    return env


def _downward_sample(pod: PodTemplate, source: dict[str, Any]) -> str:
    field = source.get("fieldRef", {}).get("fieldPath")
    if field == POD_INDEX_FIELD:
        assert pod.pod_index is not None, "pod-index label read outside a StatefulSet"
        return str(pod.pod_index)
    if field == "metadata.namespace":
        return NAMESPACE
    if field == "status.podIP":
        return SAMPLE_POD_IP
    raise AssertionError(f"no sample value for valueFrom {source}")


def expanded_args(pod: PodTemplate, container: dict[str, Any], rendered: Rendered) -> list[str]:
    """The container's argv after the kubelet's expansion; every reference must resolve."""
    env = container_env(pod, container, rendered)
    argv = [expand(a, env) for a in [*container.get("command", []), *container.get("args", [])]]
    unresolved = [a for a in argv if _REFERENCE.search(a)]
    assert not unresolved, f"{container['name']}: undefined $(VAR) references: {unresolved}"
    return argv


def parse_strictly(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """parse_args that turns argparse's exit into an AssertionError carrying its message."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parser.parse_args(list(argv))
    except SystemExit as exc:
        raise AssertionError(
            f"{parser.prog} rejects {list(argv)}:\n{stderr.getvalue().strip()}"
        ) from exc


def leaf_paths(values: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Dotted paths of the leaves of a values tree (lists and empty maps are leaves)."""
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from leaf_paths(value, f"{path}.")
        else:
            yield path


def mount_secrets(
    pod: PodTemplate, container: dict[str, Any], rendered: Rendered, root: Path
) -> dict[str, Path]:
    """What the kubelet does for the container's Secret volumes, under `root`: each mounted
    Secret's files (its `items`, or the TLS keys), holding the rendered Secret's value when the
    release renders it and a sample otherwise. Returns {mountPath: local directory}."""
    volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
    rendered_secrets = {m["metadata"]["name"]: m for m in rendered.of_kind("Secret")}
    mounted: dict[str, Path] = {}
    for mount in container.get("volumeMounts", []):
        secret = volumes[mount["name"]].get("secret")
        if secret is None:
            continue
        assert mount.get("readOnly") is True, f"{mount['name']} is mounted writable"
        local = root / mount["mountPath"].lstrip("/")
        local.mkdir(parents=True, exist_ok=True)
        keys = [item["key"] for item in secret.get("items", [])] or list(TLS_KEYS)
        data = rendered_secrets.get(secret["secretName"], {}).get("data", {})
        for key in keys:
            value = base64.b64decode(data[key]) if key in data else b"sample-" + key.encode()
            (local / key).write_bytes(value + b"\n")
        mounted[mount["mountPath"]] = local
    return mounted


def localized(argv: Sequence[str], mounted: dict[str, Path]) -> list[str]:
    """`argv` with paths inside the mounts replaced by their local copies (`mount_secrets`)."""

    def local(arg: str) -> str:
        for path, copy in mounted.items():
            flag, sep, value = arg.rpartition("=")
            if value == path or value.startswith(f"{path}/"):
                return f"{flag}{sep}{copy}{value[len(path) :]}"
        return arg

    return [local(arg) for arg in argv]
