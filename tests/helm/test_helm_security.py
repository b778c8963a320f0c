"""The chart's security wiring: the role-token Secret and which container mounts which token,
the flags that point at them (--insecure only with auth off), TLS, the NetworkPolicies and the
pods they select, the NIXL listener on the pod IP and its port range, and the path roots."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
from chart_harness import (
    SAMPLE_POD_IP,
    PodTemplate,
    Rendered,
    container_env,
    expanded_args,
    load_value_set,
    localized,
    mount_secrets,
    pod_templates,
    render,
)

from refit_sidecar.service.cli import parse_config as sidecar_config
from trainer_svc.cli import build_parser
from trainer_svc.cli import config_from_args as trainer_config

TOKENS = "/var/run/secrets/trainer-refit/tokens"
TLS = "/var/run/secrets/trainer-refit/tls"
ROLES = {"orchestrator", "trainer", "receiver"}


def _pods(rendered: Rendered) -> dict[str, PodTemplate]:
    """One sample pod of each kind: "head", "worker" (when there are workers), "vllm"."""
    return {pod.role or "vllm": pod for pod in pod_templates(rendered)}


def _argv(pod: PodTemplate, container: str, rendered: Rendered) -> list[str]:
    return expanded_args(pod, pod.container(container), rendered)


def _trainer_args(rendered: Rendered, role: str = "head") -> list[str]:
    argv = _argv(_pods(rendered)[role], "trainer", rendered)
    return argv[argv.index("trainer_svc") + 1 :]


def _refit_options(rendered: Rendered) -> dict[str, Any]:
    argv = _argv(_pods(rendered)["vllm"], "vllm", rendered)
    (config,) = [a for a in argv if a.startswith("--additional-config=")]
    options: dict[str, Any] = json.loads(config.split("=", 1)[1])["refit"]
    return options


def _mounted_secrets(pod: PodTemplate, container: str) -> dict[str, tuple[str, list[str]]]:
    """mountPath -> (Secret name, keys projected), for the container's Secret volumes."""
    volumes = {v["name"]: v for v in pod.spec["volumes"]}
    found = {}
    for mount in pod.container(container).get("volumeMounts", []):
        secret = volumes[mount["name"]].get("secret")
        if secret is not None:
            assert mount["readOnly"] is True
            keys = [i["key"] for i in secret.get("items", [])]
            found[mount["mountPath"]] = (secret["secretName"], keys)
    return found


def test_the_generated_secret_holds_a_token_per_role(chart: helm.Chart) -> None:
    rendered = render(chart, None)
    (secret,) = rendered.of_kind("Secret")
    assert secret["metadata"]["name"] == "rl-trainer-refit-auth"
    assert set(secret["data"]) == ROLES
    tokens = {role: base64.b64decode(value).decode() for role, value in secret["data"].items()}
    assert all(re.fullmatch(r"[A-Za-z0-9]{48}", t) for t in tokens.values()), tokens
    assert len(set(tokens.values())) == 3
    assert not render(chart, {"auth": {"existingSecret": "mine"}}).of_kind("Secret")
    assert not render(chart, {"auth": {"enabled": False}}).of_kind("Secret")


def test_each_container_mounts_only_the_tokens_it_uses(chart: helm.Chart) -> None:
    for values, secret in (
        (None, "rl-trainer-refit-auth"),
        ({"auth": {"existingSecret": "mine"}}, "mine"),
    ):
        pods = _pods(render(chart, values))
        assert _mounted_secrets(pods["head"], "trainer") == {
            TOKENS: (secret, ["orchestrator", "trainer"])
        }
        assert _mounted_secrets(pods["head"], "refit-sidecar") == {
            TOKENS: (secret, ["trainer", "receiver"])
        }
        assert _mounted_secrets(pods["vllm"], "vllm") == {TOKENS: (secret, ["receiver"])}


def test_the_flags_point_into_the_mounted_tokens(chart: helm.Chart) -> None:
    rendered = render(chart, load_value_set("multinode-tp-pp-rdma"))
    pods = _pods(rendered)
    for role in ("head", "worker"):
        args = _trainer_args(rendered, role)
        assert f"--auth-token-dir={TOKENS}" in args
        assert f"--sidecar-token-file={TOKENS}/trainer" in args
        assert "--insecure" not in args
    sidecar = _argv(pods["head"], "refit-sidecar", rendered)
    assert f"--auth-token-dir={TOKENS}" in sidecar and "--insecure" not in sidecar
    options = _refit_options(rendered)
    assert options["token_file"] == f"{TOKENS}/receiver" and "insecure" not in options


def test_insecure_only_when_auth_is_off(chart: helm.Chart) -> None:
    rendered = render(chart, {"auth": {"enabled": False}})
    pods = _pods(rendered)
    trainer = _trainer_args(rendered)
    assert "--insecure" in trainer
    assert not [a for a in trainer if a.startswith(("--auth-token-dir", "--sidecar-token-file"))]
    sidecar = _argv(pods["head"], "refit-sidecar", rendered)
    assert "--insecure" in sidecar and not [a for a in sidecar if "token" in a]
    options = _refit_options(rendered)
    assert options["insecure"] is True
    assert not {"token_file", "tls_ca", "tls_cert", "tls_key"} & set(options)
    for pod in pods.values():
        assert not [v for v in pod.spec["volumes"] if "secret" in v]
    # Both programs accept their flags as they are.
    config = trainer_config(build_parser().parse_args(trainer))
    assert config.server.auth.insecure
    assert sidecar_config(sidecar[1:])[0].auth.insecure


def test_mutual_tls_is_wired_to_every_flag_and_probe(chart: helm.Chart, tmp_path: Path) -> None:
    values = {"auth": {"tls": {"secretName": "certs", "mutual": True}}}
    rendered = render(chart, values)
    pods = _pods(rendered)
    trainer = _trainer_args(rendered)
    for flag, file in (
        ("--tls-cert", "tls.crt"),
        ("--tls-key", "tls.key"),
        ("--tls-client-ca", "ca.crt"),
        ("--sidecar-tls-ca", "ca.crt"),
        ("--sidecar-tls-cert", "tls.crt"),
        ("--sidecar-tls-key", "tls.key"),
    ):
        assert f"{flag}={TLS}/{file}" in trainer
    sidecar = _argv(pods["head"], "refit-sidecar", rendered)
    for flag, file in (
        ("--tls-cert", "tls.crt"),
        ("--tls-key", "tls.key"),
        ("--tls-client-ca", "ca.crt"),
    ):
        assert f"{flag}={TLS}/{file}" in sidecar
    options = _refit_options(rendered)
    assert (options["tls_ca"], options["tls_cert"], options["tls_key"]) == (
        f"{TLS}/ca.crt",
        f"{TLS}/tls.crt",
        f"{TLS}/tls.key",
    )
    for pod, container in (
        (pods["head"], "trainer"),
        (pods["head"], "refit-sidecar"),
        (pods["vllm"], "vllm"),
    ):
        assert _mounted_secrets(pod, container)[TLS] == ("certs", [])
    # The kubelet's gRPC probes speak plaintext: with TLS they check the port accepts connections.
    for container, port in (("trainer", 50051), ("refit-sidecar", 50052)):
        spec = pods["head"].container(container)
        for kind in ("startup", "readiness", "liveness"):
            assert spec[f"{kind}Probe"]["tcpSocket"] == {"port": port}
    # The programs accept the flags with the Secrets' files in place.
    head = pods["head"]
    mounted = mount_secrets(head, head.container("trainer"), rendered, tmp_path / "trainer")
    config = trainer_config(build_parser().parse_args(localized(trainer, mounted)))
    assert config.server.auth.tls_client_ca is not None and config.refit.auth.tls_cert is not None
    mounted = mount_secrets(head, head.container("refit-sidecar"), rendered, tmp_path / "sidecar")
    assert sidecar_config(localized(sidecar[1:], mounted))[0].auth.tls_cert is not None


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _selected(peer: dict[str, Any], pods: dict[str, PodTemplate]) -> set[str]:
    """Which of this release's pods a NetworkPolicyPeer admits (namespace-local selectors)."""
    if "podSelector" not in peer or "namespaceSelector" in peer:
        return set()
    return {name for name, pod in pods.items() if _selects(peer["podSelector"], pod.labels)}


def test_network_policies_select_the_right_pods_and_ports(chart: helm.Chart) -> None:
    orchestrator = {"namespaceSelector": {"matchLabels": {"team": "rl"}}}
    peer = {"ipBlock": {"cidr": "10.9.0.0/16"}}
    rendered = render(
        chart,
        {
            "trainer": {"nodes": 2, "layout": {"tp": 8, "pp": 2, "dp": 1}},
            "networkPolicy": {"orchestrators": [orchestrator], "refitPeers": [peer]},
        },
    )
    pods = _pods(rendered)
    assert set(pods) == {"head", "worker", "vllm"}
    policies = {p["metadata"]["name"]: p["spec"] for p in rendered.of_kind("NetworkPolicy")}
    assert set(policies) == {"rl-trainer-refit-trainer", "rl-trainer-refit-vllm"}
    nixl = {"protocol": "TCP", "port": 43000, "endPort": 43999}
    for spec in policies.values():
        assert spec["policyTypes"] == ["Ingress"]
        assert all(rule.get("from") for rule in spec["ingress"]), "a rule without peers admits all"

    trainer = policies["rl-trainer-refit-trainer"]
    assert {n for n, p in pods.items() if _selects(trainer["podSelector"], p.labels)} == {
        "head",
        "worker",
    }
    ranks, receivers, orchestrators = trainer["ingress"]
    assert [_selected(p, pods) for p in ranks["from"]] == [{"head", "worker"}]
    assert "ports" not in ranks  # every port among the ranks
    assert [_selected(p, pods) for p in receivers["from"][:1]] == [{"vllm"}]
    assert receivers["from"][1:] == [peer]
    assert receivers["ports"] == [{"protocol": "TCP", "port": 50052}, nixl]
    assert orchestrators == {"from": [orchestrator], "ports": [{"protocol": "TCP", "port": 50051}]}

    vllm = policies["rl-trainer-refit-vllm"]
    assert {n for n, p in pods.items() if _selects(vllm["podSelector"], p.labels)} == {"vllm"}
    sources, clients = vllm["ingress"]
    assert [_selected(p, pods) for p in sources["from"][:2]] == [{"head", "worker"}, {"vllm"}]
    assert sources["from"][2:] == [peer] and sources["ports"] == [nixl]
    assert clients == {"from": [orchestrator], "ports": [{"protocol": "TCP", "port": 8000}]}


def test_network_policies_without_peers_and_disabled(chart: helm.Chart) -> None:
    rendered = render(chart, {"vllm": {"enabled": False}})
    (policy,) = rendered.of_kind("NetworkPolicy")
    (ranks,) = policy["spec"]["ingress"]  # no receivers, no refitPeers, no orchestrators
    assert ranks["from"] and "ports" not in ranks
    assert not render(chart, {"networkPolicy": {"enabled": False}}).of_kind("NetworkPolicy")


@pytest.mark.parametrize(
    ("name", "host", "devices"),
    [
        ("default", SAMPLE_POD_IP, []),
        ("multinode-tp-pp-rdma", SAMPLE_POD_IP, ["mlx5_0:1"]),
        ("leaderworkerset", "0.0.0.0", []),  # RDMA without a device list: UCX picks
    ],
)
def test_the_nixl_listener_is_bound_to_the_pod_ip(
    chart: helm.Chart, name: str, host: str, devices: list[str]
) -> None:
    rendered = render(chart, load_value_set(name))
    for pod in pod_templates(rendered):
        container = pod.container("trainer" if pod.role else "vllm")
        env = container_env(pod, container, rendered)
        assert env["UCX_TCP_PORT_RANGE"] == "43000-43999"
        if not pod.role:
            continue
        if host == SAMPLE_POD_IP:
            (entry,) = [e for e in container["env"] if e["name"] == "POD_IP"]
            assert entry["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        args = build_parser().parse_args(_trainer_args(rendered, pod.role))
        assert (args.nixl_host, args.nixl_net_devices) == (host, devices)


def test_path_roots(chart: helm.Chart) -> None:
    def roots(values: dict[str, Any] | None) -> list[str]:
        return [
            a.split("=", 1)[1]
            for a in _trainer_args(render(chart, values))
            if a.startswith("--path-root=")
        ]

    assert roots(None) == ["/checkpoints"]
    assert roots({"checkpoints": {"mountPath": "/ckpt"}}) == ["/ckpt"]
    assert roots({"checkpoints": {"enabled": False}}) == []
    assert roots({"trainer": {"pathRoots": ["/data/a", "/data/b"]}}) == ["/data/a", "/data/b"]
