"""The flags the chart passes to each container exist in the programs' real command-line parsers.

Each container's argv is taken from the rendered pod template and expanded the way the kubelet does
($(VAR) from the release ConfigMap, the downward API and the LWS webhook), then parsed by the parser
the program itself uses: torchrun's, trainer_svc.cli.build_parser(),
refit_sidecar.service.cli.build_parser() and `vllm serve`'s. The parsed values must agree with the
pod's GPUs, ports, probes and Services. For vLLM, what the flags configure must also be accepted by
the code that reads it: the weight-transfer backend by vLLM's factory, the refit section of
--additional-config by inference_ext (worker extension and auto-refit endpoint plugin), and
VLLM_PLUGINS by vLLM's plugin loaders.
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
    AUTO_REFIT_FIELDS,
    CHART_DIR,
    GPU_RESOURCE,
    LWS_KIND,
    NAMESPACE,
    PodTemplate,
    Rendered,
    container_env,
    expanded_args,
    load_value_set,
    localized,
    mount_secrets,
    parse_strictly,
    pod_templates,
    value_set_names,
)

from inference_ext.auto_config import AutoRefitConfig
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
        assert args.attention == trainer["attention"]
        assert config.refit.publish_start == (
            trainer["publishStart"] and values["sidecar"]["enabled"]
        )
        assert args.pass_token_budget == trainer.get("passTokenBudget")  # null: derived
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
    from refit_sidecar.service.cli import build_parser, parse_config

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


def _vllm_serve(rendered: Rendered, vllm_cli: VllmCli) -> tuple[PodTemplate, argparse.Namespace]:
    """The receiver pod and its `vllm serve` flags, parsed and validated by vLLM."""
    parser, validate = vllm_cli
    (pod,) = [p for p in pod_templates(rendered) if p.role is None]
    argv = expanded_args(pod, pod.container("vllm"), rendered)
    assert argv[:2] == ["vllm", "serve"]
    args = parse_strictly(parser, argv[1:])
    validate(args)
    return pod, args


def _vllm_config(args: argparse.Namespace) -> Any:
    """The parts of the VllmConfig that `vllm serve` builds from these flags which refit reads,
    as vLLM's own config objects (the model's config would need the checkpoint)."""
    from vllm.config import ParallelConfig, VllmConfig

    parallel = ParallelConfig(
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size,
        worker_extension_cls=args.worker_extension_cls,
    )
    return VllmConfig(
        parallel_config=parallel,
        additional_config=args.additional_config,
        weight_transfer_config=args.weight_transfer_config,
    )


@pytest.mark.parametrize("name", _sets_with("vllm"))
def test_vllm_flags_exist_in_vllm_serve_parser(
    rendered_set: RenderedSet, vllm_cli: VllmCli, name: str
) -> None:
    rendered, values = rendered_set(name), _values(name)
    receiver = values["vllm"]
    pod, args = _vllm_serve(rendered, vllm_cli)
    container = pod.container("vllm")

    assert args.model_tag == (receiver["modelPath"] or values["model"]["path"])
    assert args.tensor_parallel_size == receiver["tensorParallelSize"]
    gpus = container["resources"]["limits"][GPU_RESOURCE]
    assert args.tensor_parallel_size * args.pipeline_parallel_size == gpus
    assert args.worker_extension_cls == receiver["workerExtensionCls"]
    # /inference/v1/generate, whose weight_versions spans attribute tokens to versions.
    assert args.enable_scale_out is True
    assert args.port == _container_port(container, "http")
    assert _probe_ports(container, "httpGet") == {"http"}
    assert {container[f"{k}Probe"]["httpGet"]["path"] for k in ("startup", "liveness")} == {
        "/health"
    }
    svc = rendered.one("Service", "-vllm")
    assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["http"]


def _expected_auto(receiver: dict[str, Any]) -> AutoRefitConfig | None:
    """What vllm.autoRefit and vllm.autoRefitOptions ask for, in AutoRefitConfig's terms."""
    if not receiver["autoRefit"]:
        return None
    options = {k: v for k, v in receiver["autoRefitOptions"].items() if v is not None}
    return AutoRefitConfig.from_value({AUTO_REFIT_FIELDS[k]: v for k, v in options.items()} or True)


@pytest.mark.parametrize("name", _sets_with("vllm"))
def test_vllm_refit_config_is_accepted_by_inference_ext(
    rendered_set: RenderedSet, vllm_cli: VllmCli, name: str
) -> None:
    from inference_ext.endpoint_plugin import auto_refit_settings, router
    from inference_ext.worker_refit import RefitTarget, additional_config_target

    rendered, values = rendered_set(name), _values(name)
    receiver = values["vllm"]
    pod, args = _vllm_serve(rendered, vllm_cli)
    if values["sidecar"]["enabled"]:
        svc = rendered.one("Service", "-sidecar")
        (port,) = [p["port"] for p in svc["spec"]["ports"]]
        address = f"{svc['metadata']['name']}.{NAMESPACE}.svc.cluster.local:{port}"
    else:
        address = receiver["sidecarAddress"]

    refit = dict(args.additional_config["refit"])
    auto = AutoRefitConfig.from_value(refit.pop("auto"))
    target = RefitTarget.from_dict(refit)  # the sidecar, after $(VAR) expansion, and options
    assert target.sidecar == address
    assert auto == _expected_auto(receiver)

    # What the worker extension and the endpoint plugin read from the engine's config.
    config = _vllm_config(args)
    assert additional_config_target(config) == target
    assert auto_refit_settings(config) == (None if auto is None else (target, auto))

    readiness = pod.container("vllm")["readinessProbe"]["httpGet"]["path"]
    if receiver["readinessGate"]["versionInstalled"]:
        assert auto is not None
        assert readiness in {r.path for r in router.routes}  # type: ignore[attr-defined]
    else:
        assert readiness == "/health"


@pytest.mark.parametrize("name", _sets_with("vllm"))
def test_vllm_weight_transfer_backend_is_registered(
    rendered_set: RenderedSet, vllm_cli: VllmCli, name: str
) -> None:
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from inference_ext import plugin

    _, args = _vllm_serve(rendered_set(name), vllm_cli)
    config = args.weight_transfer_config
    assert isinstance(config, WeightTransferConfig)  # vLLM's parser built it from the JSON
    assert config.backend == plugin.BACKEND
    plugin.register()  # what the general plugin does in every vLLM process
    # vLLM has no public lookup; create_engine resolves the name through this registry.
    engine = WeightTransferEngineFactory._registry[config.backend]()
    assert issubclass(engine, WeightTransferEngine)


@pytest.mark.parametrize("name", _sets_with("vllm"))
def test_vllm_plugins_load_the_package_plugins(
    rendered_set: RenderedSet, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm import envs
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_endpoint_plugins, load_plugins_by_group

    from inference_ext import plugin
    from inference_ext.endpoint_plugin import TrainerRefitEndpoints

    rendered, receiver = rendered_set(name), _values(name)["vllm"]
    (pod,) = [p for p in pod_templates(rendered) if p.role is None]
    env = container_env(pod, pod.container("vllm"), rendered)
    assert env["VLLM_PLUGINS"] == ",".join([plugin.BACKEND, *receiver["extraPlugins"]])
    # vLLM's own loaders, reading VLLM_PLUGINS as the container's vLLM processes will.
    monkeypatch.setenv("VLLM_PLUGINS", env["VLLM_PLUGINS"])
    envs.disable_envs_cache()
    assert load_plugins_by_group(DEFAULT_PLUGINS_GROUP)[plugin.BACKEND] is plugin.register
    endpoints = load_endpoint_plugins(("generate",))
    assert [type(e) for e in endpoints] == [TrainerRefitEndpoints]


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
        (("trainer", "attention"), "--attention"),
        (("trainer", "sequenceLayout"), "--sequence-layout"),
        (("trainer", "packedAttention"), "--packed-attention"),
        (("trainer", "cudaGraphs"), "--cuda-graphs"),
        (("trainer", "referencePolicy"), "--reference-policy"),
        (("trainer", "referencePlacement"), "--reference-placement"),
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
