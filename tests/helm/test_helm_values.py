"""Invalid values are rejected, by values.schema.json or templates/_validate.tpl, with a message
that names the value to fix; `helm lint` reports the same problem."""

from __future__ import annotations

import re
from typing import Any

import helm_python as helm
import pytest
from chart_harness import CHART_DIR, leaf_paths, load_value_set, render_error

# (id, values on top of the defaults, fragments the error message must contain)
BAD_VALUES: list[tuple[str, dict[str, Any], list[str]]] = [
    ("negative-vllm-replicas", {"vllm": {"replicas": -1}}, ["/vllm/replicas", "minimum"]),
    ("zero-trainer-nodes", {"trainer": {"nodes": 0}}, ["/trainer/nodes", "minimum"]),
    ("negative-tp", {"trainer": {"layout": {"tp": -2}}}, ["/trainer/layout/tp", "minimum"]),
    (
        "vllm-tp-zero",
        {"vllm": {"tensorParallelSize": 0}},
        ["/vllm/tensorParallelSize", "minimum"],
    ),
    (
        "tp-does-not-divide-gpus",
        {"trainer": {"nodes": 3, "gpusPerNode": 4, "layout": {"tp": 3, "pp": 1, "dp": 4}}},
        ["trainer.layout.tp = 3 does not divide trainer.gpusPerNode = 4"],
    ),
    (
        "layout-does-not-match-gpus",
        {"trainer": {"layout": {"tp": 4, "pp": 1, "dp": 1}}},
        ["tp*pp*dp = 4*1*1 = 4 ranks", "trainer.nodes*trainer.gpusPerNode = 1*8 = 8 GPUs"],
    ),
    ("empty-model-path", {"model": {"path": ""}}, ["model.path is required"]),
    ("null-model-path", {"model": {"path": None}}, ["model.path is required"]),
    (
        "receivers-without-model-path",
        {**(load_value_set("vllm-only") or {}), "model": {"path": ""}},
        ["model path is required for the vLLM receivers", "model.path"],
    ),
    (
        "receivers-without-sidecar",
        {"trainer": {"enabled": False}, "sidecar": {"enabled": False}},
        ["vllm.sidecarAddress (HOST:PORT) is required"],
    ),
    (
        "sidecar-without-trainer",
        {"trainer": {"enabled": False}},
        ["sidecar.enabled needs trainer.enabled"],
    ),
    (
        "nothing-to-deploy",
        {"trainer": {"enabled": False}, "sidecar": {"enabled": False}, "vllm": {"enabled": False}},
        ["nothing to deploy"],
    ),
    (
        "bad-sidecar-address",
        {"vllm": {"sidecarAddress": "sidecar-without-port"}},
        ["/vllm/sidecarAddress", "does not match pattern"],
    ),
    (
        "multi-node-on-readwriteonce",
        {
            "trainer": {"nodes": 2, "layout": {"tp": 8, "pp": 2, "dp": 1}},
            "checkpoints": {"accessModes": ["ReadWriteOnce"]},
        },
        ["add ReadWriteMany to checkpoints.accessModes"],
    ),
    (
        "unknown-dtype",
        {"model": {"paramsDtype": "fp16"}},
        ["/model/paramsDtype", "must be one of 'float32', 'bfloat16'"],
    ),
    ("misspelt-key", {"trainer": {"gpuPerNode": 8}}, ["/trainer", "gpuPerNode"]),
    ("port-out-of-range", {"sidecar": {"port": 70000}}, ["/sidecar/port", "maximum"]),
    (
        "receivers-of-another-sidecar-without-its-token",
        {**(load_value_set("vllm-only") or {}), "auth": {"existingSecret": ""}},
        ["auth.existingSecret is required for receivers of another release's sidecar"],
    ),
    (
        "mutual-tls-without-certificates",
        {"auth": {"tls": {"mutual": True}}},
        ["auth.tls.mutual needs auth.tls.secretName"],
    ),
    (
        "nixl-port-range-reversed",
        {"nixl": {"tcpPortRange": {"start": 44000, "end": 43000}}},
        ["nixl.tcpPortRange.start = 44000 is after nixl.tcpPortRange.end = 43000"],
    ),
    (
        "nixl-port-below-1024",
        {"nixl": {"tcpPortRange": {"start": 80, "end": 90}}},
        ["/nixl/tcpPortRange/start", "minimum"],
    ),
    (
        "relative-path-root",
        {"trainer": {"pathRoots": ["checkpoints"]}},
        ["/trainer/pathRoots/0", "does not match pattern"],
    ),
    (
        "misspelt-network-peer",
        {"networkPolicy": {"orchestrators": [{"podSelektor": {}}]}},
        ["/networkPolicy/orchestrators/0", "podSelektor"],
    ),
    (
        "readiness-gate-without-auto-refit",
        {"vllm": {"autoRefit": False, "readinessGate": {"versionInstalled": True}}},
        ["vllm.readinessGate.versionInstalled needs vllm.autoRefit"],
    ),
    (
        "auto-refit-options-without-auto-refit",
        {
            "vllm": {
                "autoRefit": False,
                "autoRefitOptions": {"policy": "every", "pauseMode": "wait"},
            }
        },
        ["vllm.autoRefitOptions (pauseMode, policy) are set but vllm.autoRefit is false"],
    ),
    (
        "auto-refit-with-another-worker-extension",
        {"vllm": {"workerExtensionCls": "my_ext.Worker"}},
        ["inference_ext.RefitWorkerExtension", "vllm.workerExtensionCls = my_ext.Worker"],
    ),
    (
        "vllm-plugins-in-vllm-env",
        {"vllm": {"env": [{"name": "VLLM_PLUGINS", "value": "other"}]}},
        ["vllm.env sets VLLM_PLUGINS", "vllm.extraPlugins"],
    ),
    (
        "vllm-plugins-in-global-env",
        {"env": [{"name": "VLLM_PLUGINS", "value": "other"}]},
        ["env sets VLLM_PLUGINS", "vllm.extraPlugins"],
    ),
    (
        "unknown-follow-policy",
        {"vllm": {"autoRefitOptions": {"policy": "oldest"}}},
        ["/vllm/autoRefitOptions/policy", "must be one of 'latest', 'every'"],
    ),
    (
        "unknown-pause-mode",
        {"vllm": {"autoRefitOptions": {"pauseMode": "drain"}}},
        ["/vllm/autoRefitOptions/pauseMode", "must be one of 'keep', 'wait', 'abort'"],
    ),
    (
        "negative-max-staleness",
        {"vllm": {"autoRefitOptions": {"maxStaleness": -1}}},
        ["/vllm/autoRefitOptions/maxStaleness", "minimum"],
    ),
    (
        "zero-poll-interval",
        {"vllm": {"autoRefitOptions": {"pollIntervalSeconds": 0}}},
        ["/vllm/autoRefitOptions/pollIntervalSeconds", "exclusiveMinimum"],
    ),
    (
        "snake-case-auto-refit-option",
        {"vllm": {"autoRefitOptions": {"max_staleness": 2}}},
        ["/vllm/autoRefitOptions", "max_staleness"],
    ),
    (
        "plugin-list-in-one-name",
        {"vllm": {"extraPlugins": ["a,b"]}},
        ["/vllm/extraPlugins/0", "does not match pattern"],
    ),
    (
        "bad-lws-restart-policy",
        {"trainer": {"leaderWorkerSet": {"enabled": True, "restartPolicy": "Sometimes"}}},
        ["/trainer/leaderWorkerSet/restartPolicy", "must be one of"],
    ),
]


@pytest.mark.parametrize(
    ("overrides", "fragments"), [pytest.param(v, f, id=i) for i, v, f in BAD_VALUES]
)
def test_bad_values_are_rejected(
    chart: helm.Chart, overrides: dict[str, Any], fragments: list[str]
) -> None:
    message = render_error(chart, overrides)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"
    if fragments[0].startswith("/"):
        # A schema violation is a lint error too. (Helm lints templates in "lint mode", where
        # `fail` only logs, so the _validate.tpl checks surface in install/upgrade/template.)
        report = helm.lint(CHART_DIR, overrides, strict=True)
        assert any(fragments[0] in e for e in report["errors"]), report["errors"]


def _documented_paths() -> set[str]:
    readme = (CHART_DIR / "README.md").read_text()
    return set(re.findall(r"^\| `([A-Za-z0-9_.]+)` \|", readme, flags=re.M))


def test_readme_documents_every_value(chart: helm.Chart) -> None:
    documented = _documented_paths()
    undocumented = []
    for path in leaf_paths(chart.values):
        parts = path.split(".")
        # A row for a nested object (e.g. trainer.probes.startup) covers its fields.
        ancestors = {".".join(parts[:n]) for n in range(2, len(parts))}
        if path not in documented and not ancestors & documented:
            undocumented.append(path)
    assert not undocumented, f"add to the README values table: {undocumented}"


def test_readme_documents_no_stale_values(chart: helm.Chart) -> None:
    paths = set(leaf_paths(chart.values))
    prefixes = {".".join(p.split(".")[:n]) for p in paths for n in range(1, p.count(".") + 2)}
    assert not _documented_paths() - prefixes
