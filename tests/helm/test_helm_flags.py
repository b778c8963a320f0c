"""The flags the chart passes to each container exist in the programs' real command-line parsers.

Each container's argv is taken from the rendered pod template and expanded the way the kubelet does
($(VAR) from the release ConfigMap, the downward API and the LWS webhook), then parsed by the
parser the program itself uses: torchrun's, trainer_svc.cli.build_parser(),
refit_sidecar.cli.build_parser() and `vllm serve`'s. The parsed values must agree with the pod's
GPUs, ports, probes and Services.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
from chart_harness import (
    CHART_DIR,
    GPU_RESOURCE,
    LWS_KIND,
    NAMESPACE,
    PodTemplate,
    Rendered,
    expanded_args,
    load_value_set,
    localized,
    mount_secrets,
    parse_strictly,
    pod_templates,
    value_set_names,
)

from trainer_svc.cli import config_from_args

RenderedSet = Callable[[str], Rendered]
VllmCli = tuple[argparse.ArgumentParser, Callable[[argparse.Namespace], None]]


@functools.cache
def _values(name: str) -> dict[str, Any]:
    with helm.Chart.load(CHART_DIR) as chart:
        return chart.merge_values(load_value_set(name))


def _sets_with(*components: str) -> list[str]:
    return [n for n in value_set_names() if all(_values(n)[c]["enabled"] for c in components)]


def _trainer_pods(rendered: Rendered) -> list[PodTemplate]:
    return [p for p in pod_templates(rendered) if p.role is not None]


def _torchrun(
    pod: PodTemplate, rendered: Rendered, torchrun_parser: argparse.ArgumentParser
) -> argparse.Namespace:
    argv = expanded_args(pod, pod.container("trainer"), rendered)
    assert argv[0] == "torchrun"
    run = parse_strictly(torchrun_parser, argv[1:])
    assert run.module and run.training_script == "trainer_svc", "runs `python -m trainer_svc`"
    return run


def _probe_ports(container: dict[str, Any], handler: str) -> set[Any]:
    return {
        container[f"{kind}Probe"][handler]["port"] for kind in ("startup", "readiness", "liveness")
    }


def _container_port(container: dict[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return int(port)


def _node_ranks(rendered: Rendered) -> set[int]:
    """Node ranks of all trainer pods the workloads will create."""
    ranks: set[int] = set()
    for m in rendered.manifests:
        if m["kind"] == "StatefulSet":
            start = m["spec"].get("ordinals", {}).get("start", 0)
            ranks |= set(range(start, start + m["spec"]["replicas"]))
        elif m["kind"] == LWS_KIND:
            ranks |= set(range(m["spec"]["leaderWorkerTemplate"]["size"]))
    return ranks


@pytest.mark.parametrize("name", _sets_with("trainer"))
def test_trainer_flags_exist_in_torchrun_and_trainer_parsers(
    rendered_set: RenderedSet,
    torchrun_parser: argparse.ArgumentParser,
    trainer_parser: argparse.ArgumentParser,
    name: str,
    tmp_path: Path,
) -> None:
    rendered, values = rendered_set(name), _values(name)
    trainer = values["trainer"]
    pods = _trainer_pods(rendered)
    has_workers = trainer["nodes"] > 1 or trainer["leaderWorkerSet"]["enabled"]  # LWS: always both
    assert {p.role for p in pods} == ({"head", "worker"} if has_workers else {"head"})
    for pod in pods:
        container = pod.container("trainer")
        run = _torchrun(pod, rendered, torchrun_parser)
        args = parse_strictly(trainer_parser, run.training_script_args)
        # The trainer's own validation of the values, token and TLS files included: those of
        # the Secrets mounted in the container.
        mounted = mount_secrets(pod, container, rendered, tmp_path / str(pod.role))
        local = localized(run.training_script_args, mounted)
        config = config_from_args(parse_strictly(trainer_parser, local))

        nnodes, nproc = int(run.nnodes), int(run.nproc_per_node)
        assert run.rdzv_backend == "static"
        assert nnodes == trainer["nodes"] and _node_ranks(rendered) == set(range(nnodes))
        assert nproc == container["resources"]["limits"][GPU_RESOURCE]
        assert config.layout.world_size == nnodes * nproc
        assert str(args.model) == values["model"]["path"]
        assert run.master_port == trainer["rendezvousPort"]
        if pod.role == "head":
            assert run.node_rank == 0
            assert args.port == _container_port(container, "grpc")
            assert _probe_ports(container, "grpc") == {args.port}
        else:
            assert 0 < run.node_rank < nnodes
            assert "ports" not in container and "readinessProbe" not in container
        if trainer["leaderWorkerSet"]["enabled"]:
            lws = rendered.one(LWS_KIND)["metadata"]["name"]
            assert run.master_addr == f"{lws}-0.{lws}.{NAMESPACE}"
        else:
            head = rendered.one("StatefulSet", "-trainer-head")
            prefix = f"{head['metadata']['name']}-0.{head['spec']['serviceName']}.{NAMESPACE}.svc."
            assert run.master_addr.startswith(prefix)


@pytest.mark.parametrize("name", _sets_with("trainer"))
def test_trainer_service_reaches_the_grpc_port(rendered_set: RenderedSet, name: str) -> None:
    rendered = rendered_set(name)
    (head,) = [p for p in _trainer_pods(rendered) if p.role == "head"]
    port = _container_port(head.container("trainer"), "grpc")
    svc = rendered.one("Service", "-trainer")
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(port, port)]


@pytest.mark.parametrize("name", _sets_with("trainer", "sidecar"))
def test_trainer_sidecar_flag(
    rendered_set: RenderedSet,
    torchrun_parser: argparse.ArgumentParser,
    trainer_parser: argparse.ArgumentParser,
    name: str,
) -> None:
    rendered = rendered_set(name)
    for pod in _trainer_pods(rendered):
        run = _torchrun(pod, rendered, torchrun_parser)
        args = parse_strictly(trainer_parser, run.training_script_args)
        host, _, port = args.sidecar.rpartition(":")
        assert host == run.master_addr  # rank 0's pod, which runs the sidecar
        assert int(port) == _values(name)["sidecar"]["port"]


def _sidecar_container(rendered: Rendered) -> dict[str, Any]:
    (head,) = [p for p in _trainer_pods(rendered) if p.role == "head"]
    return head.container("refit-sidecar")


@pytest.mark.parametrize("name", _sets_with("trainer", "sidecar"))
def test_sidecar_probes_and_service_use_its_port(rendered_set: RenderedSet, name: str) -> None:
    rendered = rendered_set(name)
    sidecar = _sidecar_container(rendered)
    port = _values(name)["sidecar"]["port"]
    assert sidecar["command"] == ["refit-sidecar"]
    assert f"--port={port}" in sidecar["args"]
    assert _container_port(sidecar, "sidecar-grpc") == port
    assert _probe_ports(sidecar, "grpc") == {port}
    svc = rendered.one("Service", "-sidecar")
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(port, port)]


def test_sidecar_flags_exist_in_refit_sidecar_parser(
    rendered_set: RenderedSet, tmp_path: Path
) -> None:
    from refit_sidecar.cli import build_parser, parse_config

    for name in _sets_with("trainer", "sidecar"):
        rendered = rendered_set(name)
        (head,) = [p for p in _trainer_pods(rendered) if p.role == "head"]
        sidecar = head.container("refit-sidecar")
        argv = expanded_args(head, sidecar, rendered)
        args = parse_strictly(build_parser(), argv[1:])
        assert args.port == _values(name)["sidecar"]["port"]
        mounted = mount_secrets(head, sidecar, rendered, tmp_path / name)
        config, _ = parse_config(localized(argv[1:], mounted))  # its own validation
        assert config.port == args.port


@pytest.mark.parametrize("name", _sets_with("vllm"))
def test_vllm_flags_exist_in_vllm_serve_parser(
    rendered_set: RenderedSet, vllm_cli: VllmCli, name: str
) -> None:
    parser, validate = vllm_cli
    rendered, values = rendered_set(name), _values(name)
    receiver = values["vllm"]
    (pod,) = [p for p in pod_templates(rendered) if p.role is None]
    container = pod.container("vllm")
    argv = expanded_args(pod, container, rendered)
    assert argv[:2] == ["vllm", "serve"]
    args = parse_strictly(parser, argv[1:])
    validate(args)

    assert args.model_tag == (receiver["modelPath"] or values["model"]["path"])
    assert args.tensor_parallel_size == receiver["tensorParallelSize"]
    gpus = container["resources"]["limits"][GPU_RESOURCE]
    assert args.tensor_parallel_size * args.pipeline_parallel_size == gpus
    assert args.worker_extension_cls == receiver["workerExtensionCls"]
    if values["sidecar"]["enabled"]:
        svc = rendered.one("Service", "-sidecar")
        (port,) = [p["port"] for p in svc["spec"]["ports"]]
        address = f"{svc['metadata']['name']}.{NAMESPACE}.svc.cluster.local:{port}"
    else:
        address = receiver["sidecarAddress"]
    refit = args.additional_config["refit"]
    assert (refit.pop("sidecar"), refit.pop("auto")) == (address, receiver["autoRefit"])
    # What the worker extension passes on to each receiver.
    from inference_ext.receiver import RefitOptions

    RefitOptions.from_dict(refit)
    assert args.port == _container_port(container, "http")
    assert _probe_ports(container, "httpGet") == {"http"}
    assert {container[f"{k}Probe"]["httpGet"]["path"] for k in ("startup", "liveness")} == {
        "/health"
    }
    svc = rendered.one("Service", "-vllm")
    assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["http"]


def test_worker_extension_class_exists() -> None:
    module, _, cls = _values("default")["vllm"]["workerExtensionCls"].rpartition(".")
    assert hasattr(importlib.import_module(module), cls)


def test_trainer_module_exists() -> None:
    # torchrun -m trainer_svc runs trainer_svc/__main__.py (pyproject: trainer_svc.__main__:main).
    assert importlib.util.find_spec("trainer_svc.__main__") is not None


@pytest.mark.parametrize(
    ("path", "flag"),
    [
        (("model", "paramsDtype"), "--params-dtype"),
        (("trainer", "device"), "--device"),
        (("trainer", "optimizer", "kind"), "--optimizer"),
        (("trainer", "logLevel"), "--log-level"),
    ],
)
def test_schema_choices_are_the_trainer_parser_choices(
    trainer_parser: argparse.ArgumentParser, path: tuple[str, ...], flag: str
) -> None:
    node = json.loads((CHART_DIR / "values.schema.json").read_text())
    for key in path:
        node = node["properties"][key]
    action = trainer_parser._option_string_actions[flag]  # argparse has no public lookup
    assert action.choices is not None
    assert sorted(node["enum"]) == sorted(action.choices)
