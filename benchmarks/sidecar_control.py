"""The sidecar's control plane alone: from a trainer rank's last report of a version to each
receiver's answer, with no bytes moved.

* ``python -m refit_sidecar`` as deployed (bearer tokens, ``--max-children`` and
  ``--max-root-children`` from ``--max-children``), as a subprocess.
* This process plays a one-rank trainer (``--refit-slots`` slots) publishing a synthetic
  Llama-shaped manifest: per layer the six tensors Megatron publishes (two norms, QKV, the
  output projection, FC1, FC2) plus embedding, final norm and output layer, one shard each, with
  checksums, as the trainer's ranks report them.
* ``--receivers`` receivers, each a process of its own, want every tensor whole and offer their
  staging (as `Receiver` through the tree does after a first pull), and name the routing key
  of the last answer that carried its routes (a receiver that kept that plan does: the
  sidecar then leaves the routes out of a steady tree's answers). Before each version they
  send their GetSources with a lease, parked on the sidecar until the version is readable
  (``Receiver.expect``); each then releases its lease and its sources, as after a pull. With
  ``--direct`` they send AcquireLease instead (no tree).
* Also: the same work called in-process (the servicer without gRPC), and the cost of an empty
  call (back to back, after 50 ms of idleness, and the sidecar's CPU per call).
* Latency: the receiver's ``time.monotonic()`` when its answer arrived minus the trainer's
  when it sent its PublishShards call (one clock for every process of the machine). The
  sidecar's answers for a tree come one after another (a child once its parent is assigned),
  so the last receiver's latency is what the control plane adds to a chain's last refit.
  The sidecar's CPU time per timed version (user and system, every thread) is reported too:
  unlike latencies, it does not depend on how fast an idle machine wakes up.

    python -m benchmarks.sidecar_control --layers 16 --receivers 3 --max-children 1

With ``--experts E`` each layer's MLP is a mixture of E experts and a router instead, published
either as Megatron's sequential experts name them, two tensors per expert
(``--expert-layout per-expert``: 18,432 expert tensors at 72 layers of 128), or one tensor per
layer and projection with the experts as its leading dimension (``grouped``: what a rank's
contiguous expert slab is, and what vLLM's fused expert weights are). The in-process figures
then include the receiver's pull plan over the whole manifest.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import json
import logging
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil

from benchmarks.harness import sidecar_server
from benchmarks.trainer_step import tokens_for
from inference_ext.expert_slices import receiver_names
from inference_ext.receiver_plan import plan_receiver
from inference_ext.slices import ReceiverLayout
from megatron_hf.convert import hf_names
from megatron_hf.spec import ModelFamily, ModelSpec, MoESpec
from refit_sidecar.core.manifest import (
    AgentRecord,
    Box,
    DType,
    Manifest,
    ParameterRecord,
    ShardLocation,
    ShardPiece,
    ShardRecord,
)
from refit_sidecar.core.plan import Want, plan_pull
from refit_sidecar.core.tree_records import TreeConfig
from refit_sidecar.service.client import SidecarClient, TrainerLayout, lease_from_proto
from refit_sidecar.service.registry import Registry, RegistryConfig
from refit_sidecar.service.server import RefitServicer
from refit_sidecar.service.sources import Offer, get_sources_request
from refit_sidecar.service.wire import publish_request
from trainer_refit.auth import ClientAuth, Role, TokenDir
from trainer_refit.v1 import common_pb2
from trainer_refit.v1 import refit_pb2 as pb

log = logging.getLogger("benchmarks.sidecar_control")

_LAYER_TENSORS = (
    ("input_layernorm.weight", "hidden"),
    ("self_attention.linear_qkv.weight", "qkv"),
    ("self_attention.linear_proj.weight", "square"),
    ("pre_mlp_layernorm.weight", "hidden"),
    ("mlp.linear_fc1.weight", "fc1"),
    ("mlp.linear_fc2.weight", "fc2"),
)
_WAIT_S = 30.0
_LEASE_S = 30.0


class ExpertLayout(enum.Enum):
    PER_EXPERT = "per-expert"
    GROUPED = "grouped"


@dataclass(frozen=True)
class Config:
    layers: int
    hidden: int
    experts: int
    expert_layout: ExpertLayout
    receivers: int
    max_children: int
    direct: bool
    slots: int
    warmup: int
    versions: int
    timeout: float
    out: Path | None


def _shapes(hidden: int) -> dict[str, tuple[int, ...]]:
    return {
        "hidden": (hidden,),
        "qkv": (3 * hidden, hidden),
        "square": (hidden, hidden),
        "fc1": (8 * hidden, hidden),
        "fc2": (hidden, 4 * hidden),
        "vocab": (4 * hidden, hidden),
    }


def tensors(config: Config) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every published tensor, in the trainer's order."""
    shapes = _shapes(config.hidden)
    out = [("embedding.word_embeddings.weight", shapes["vocab"])]
    for layer in range(config.layers):
        prefix = f"decoder.layers.{layer}"
        for name, kind in _LAYER_TENSORS:
            if config.experts and name.startswith("mlp."):
                continue
            out.append((f"{prefix}.{name}", shapes[kind]))
        if config.experts:
            out += _experts(config, prefix, shapes)
    out += [("decoder.final_layernorm.weight", shapes["hidden"])]
    out += [("output_layer.weight", shapes["vocab"])]
    return out


def _experts(
    config: Config, prefix: str, shapes: dict[str, tuple[int, ...]]
) -> list[tuple[str, tuple[int, ...]]]:
    """A layer's router and experts (each expert as wide as the dense MLP)."""
    out = [(f"{prefix}.mlp.router.weight", (config.experts, config.hidden))]
    if config.expert_layout is ExpertLayout.GROUPED:
        for projection in ("fc1", "fc2"):
            shape = (config.experts, *shapes[projection])
            out.append((f"{prefix}.mlp.experts.linear_{projection}.weight", shape))
        return out
    for expert in range(config.experts):
        for projection in ("fc1", "fc2"):
            name = f"{prefix}.mlp.experts.local_experts.{expert}.linear_{projection}.weight"
            out.append((name, shapes[projection]))
    return out


def model_spec(config: Config) -> ModelSpec:
    """The model the manifest is of, as a vLLM worker's refit plans it: Mixtral's names (no q/k
    norms, as the manifest has none), heads of 64, every MLP and expert 4x hidden wide."""
    heads = max(1, config.hidden // 64)
    return ModelSpec(
        family=ModelFamily.MIXTRAL if config.experts else ModelFamily.LLAMA,
        architecture="MixtralForCausalLM" if config.experts else "LlamaForCausalLM",
        num_layers=config.layers,
        hidden_size=config.hidden,
        ffn_hidden_size=4 * config.hidden,
        num_attention_heads=heads,
        num_query_groups=heads,
        head_dim=config.hidden // heads,
        vocab_size=4 * config.hidden,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qkv_bias=False,
        qk_layernorm=False,
        moe=MoESpec(
            num_experts=config.experts,
            top_k=min(8, config.experts),
            ffn_hidden_size=4 * config.hidden,
            norm_topk_prob=True,
        )
        if config.experts
        else None,
    )


def trainer_part(config: Config, version: int, agent: str) -> Manifest:
    """The one rank's report of `version`: every tensor whole in the slot of `version`."""
    slot_base = (1 << 32) * (1 + version % config.slots)
    address = slot_base
    params = []
    for index, (name, shape) in enumerate(tensors(config)):
        location = ShardLocation.contiguous(agent=agent, address=address, shape=shape, itemsize=2)
        address += location.nbytes
        piece = ShardPiece(Box.full(shape), (0,) * len(shape))
        checksum = (version << 20) + index
        shard = ShardRecord(location, (piece,), checksum, rank=0, sum64=checksum << 8)
        params.append(ParameterRecord(name, shape, DType.BFLOAT16, (shard,)))
    return Manifest(version, tuple(params), {agent: AgentRecord(agent, b"meta", rank=0)})


def receiver_offer(config: Config, receiver: str) -> tuple[list[Want], Offer]:
    wants = [Want(name, Box.full(shape)) for name, shape in tensors(config)]
    address = 1 << 40
    locations = []
    for want in wants:
        location = ShardLocation.contiguous(
            agent=receiver, address=address, shape=want.box.shape, itemsize=2
        )
        locations.append(location)
        address += location.nbytes
    progress = ShardLocation.contiguous(agent=receiver, address=address, shape=(24,), itemsize=1)
    return wants, Offer(AgentRecord(receiver, b"peer-meta"), tuple(locations), progress)


# -- a receiver process ---------------------------------------------------------------------------


def _receiver_main(
    config: Config, sidecar: str, token_file: str, name: str, conn: Connection
) -> None:
    """Per command (a version): park the call for it, answer "parked"; when its answer comes,
    report the arrival time, release as after a pull, answer "done"."""
    auth = ClientAuth(token_file=Path(token_file))
    with SidecarClient(sidecar, timeout=config.timeout, auth=auth) as client:
        wants, offer = receiver_offer(config, name)
        template = get_sources_request(0, name, wants, offer=offer, wait_s=_WAIT_S)
        template.lease_ttl_seconds = _LEASE_S
        template.lease_with_checksums = True
        conn.send("ready")
        known: bytes | None = None
        primaries: list[str] = []
        """The routing key of the last answer: named in the next request, as a receiver that
        kept that answer's plan does (the sidecar then leaves the routes out)."""
        while (version := conn.recv()) is not None:
            if config.direct:
                pending: Any = client.lease_later(
                    version, name, _LEASE_S, wait_s=_WAIT_S, checksums=True
                )
            else:
                request = type(template)()
                request.CopyFrom(template)
                request.version = version
                if known is not None:
                    request.known_routing_keys.append(known)
                pending = client.ask_later(request)
            conn.send("parked")
            answer = pending.result()
            arrived = time.monotonic()
            if config.direct:
                client.release_lease(answer)
            else:
                if not answer.reply.routes_left_out:
                    known, primaries = answer.key, list(answer.primaries)
                client.release_sources(version, name, complete=True)
                client.release_lease(lease_from_proto(answer.reply.lease))
            conn.send((arrived, None if config.direct else primaries))


@contextlib.contextmanager
def receivers(config: Config, sidecar: str, tokens: TokenDir) -> Iterator[list[Connection]]:
    context = multiprocessing.get_context("spawn")
    processes, conns = [], []
    try:
        for i in range(config.receivers):
            mine, theirs = context.Pipe()
            name = f"receiver-{i}"
            process = context.Process(
                target=_receiver_main,
                args=(config, sidecar, str(tokens.file(Role.RECEIVER)), name, theirs),
                daemon=True,
            )
            process.start()
            processes.append(process)
            conns.append(mine)
        for conn in conns:
            if not conn.poll(config.timeout) or conn.recv() != "ready":
                raise RuntimeError("a receiver did not start")
        yield conns
    finally:
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


# -- the driver -----------------------------------------------------------------------------------


def _cpu_seconds(work: Path) -> float:
    """CPU time (user + system) the sidecar serving `work` has used so far."""
    for process in psutil.Process().children():
        if "refit_sidecar" in process.cmdline() and str(work) in " ".join(process.cmdline()):
            times = process.cpu_times()
            return float(times.user + times.system)
    raise RuntimeError("the sidecar process is not a child of this one")


def empty_calls(
    client: SidecarClient, sidecar_cpu: Callable[[], float], calls: int = 300
) -> dict[str, float]:
    """The cost of a call that does nothing (GetLatestVersion): its round trip back to back,
    the sidecar's CPU per call, and its round trip after 50 ms of idleness (a machine that
    sleeps when idle wakes up slowly)."""
    for _ in range(20):
        client.latest_version()
    times = []
    cpu = sidecar_cpu()
    for _ in range(calls):
        start = time.perf_counter()
        client.latest_version()
        times.append(time.perf_counter() - start)
    cpu = (sidecar_cpu() - cpu) / calls
    idle = []
    for _ in range(20):
        time.sleep(0.05)
        start = time.perf_counter()
        client.latest_version()
        idle.append(time.perf_counter() - start)
    return dict(
        empty_call_s=statistics.median(times),
        empty_call_cpu_s=cpu,
        empty_call_after_idle_s=statistics.median(idle),
    )


class _Context:
    """What the servicer's error handling needs of a gRPC context, in-process."""

    async def abort_with_status(self, status: Any) -> None:
        raise RuntimeError(f"the sidecar refused an in-process call: {status}")

    def peer(self) -> str:
        return "in-process"


def in_process(config: Config, versions: int = 40, warmup: int = 5) -> dict[str, float]:
    """The sidecar's own work for one version without gRPC: the servicer called directly
    (the version readable before the receivers ask). Medians of the publication (the report,
    and opening the version's tree) and of one answer (the lease and, unless direct, the
    sources)."""
    return asyncio.run(_in_process(config, versions, warmup))


async def _in_process(config: Config, versions: int, warmup: int) -> dict[str, float]:
    tree = TreeConfig(max_children=config.max_children, max_root_children=config.max_children)
    servicer = RefitServicer(Registry(RegistryConfig()), tree)
    context = _Context()
    layout = common_pb2.ParallelLayout(tensor_parallel=1, world_size=1)
    request = pb.RegisterTrainerRequest(layout=layout, num_slots=config.slots, owner="benchmark")
    generation = (await servicer.RegisterTrainer(request, context)).generation
    asks = []
    for i in range(config.receivers):
        wants, offer = receiver_offer(config, f"receiver-{i}")
        ask = get_sources_request(0, f"receiver-{i}", wants, offer=offer)
        ask.lease_ttl_seconds = _LEASE_S
        ask.lease_with_checksums = True
        asks.append(ask)
    publications, answers, plans, worker_plans = [], [], [], []
    # A vLLM worker's own plan (TP=1: its targets, fused experts included), where the experts
    # are published grouped as the trainer publishes them.
    spec = model_spec(config)
    worker = None
    if not config.experts or config.expert_layout is ExpertLayout.GROUPED:
        worker = receiver_names(spec, [n for n in hf_names(spec) if n != "lm_head.weight"])
        worker.append("lm_head.weight")
    for version in range(1, warmup + versions + 1):
        reserve = pb.ReserveSlotRequest(version=version, generation=generation)
        await servicer.ReserveSlot(reserve, context)
        report = publish_request(version, 0, trainer_part(config, version, "trainer-rank0"))
        report.generation = generation
        start = time.perf_counter()
        await servicer.PublishShards(report, context)
        await asyncio.sleep(0)  # what the publication scheduled (opening the tree)
        published = time.perf_counter()
        leases = []
        for ask in asks:
            begin = time.perf_counter()
            if config.direct:
                leases.append(await servicer.AcquireLease(_acquire(ask, version), context))
            else:
                ask.version = version
                leases.append((await servicer.GetSources(ask, context)).lease)
            if version > warmup:
                answers.append(time.perf_counter() - begin)
        if version > warmup:
            publications.append(published - start)
            manifest = trainer_part(config, version, "trainer-rank0")
            begin = time.perf_counter()
            plan_pull(manifest, wants)
            plans.append(time.perf_counter() - begin)
            if worker is not None:
                begin = time.perf_counter()
                plan_receiver(manifest, spec, ReceiverLayout(0, 1), worker)
                worker_plans.append(time.perf_counter() - begin)
        for ask, lease in zip(asks, leases, strict=True):
            if not config.direct:
                release = pb.ReleaseSourcesRequest(
                    version=version, receiver_id=ask.receiver_id, complete=True
                )
                await servicer.ReleaseSources(release, context)
            end = pb.ReleaseLeaseRequest(lease_id=lease.lease_id, receiver_id=ask.receiver_id)
            await servicer.ReleaseLease(end, context)
    return dict(
        in_process_publication_s=statistics.median(publications),
        in_process_answer_s=statistics.median(answers),
        in_process_plan_s=statistics.median(plans),
        **({"in_process_worker_plan_s": statistics.median(worker_plans)} if worker_plans else {}),
    )


def _acquire(ask: pb.GetSourcesRequest, version: int) -> pb.AcquireLeaseRequest:
    return pb.AcquireLeaseRequest(
        version=version,
        receiver_id=ask.receiver_id,
        ttl_seconds=ask.lease_ttl_seconds,
        with_checksums=ask.lease_with_checksums,
    )


def run(config: Config, work: Path) -> dict[str, Any]:
    tokens = tokens_for(work)
    flags = ["--max-children", str(config.max_children)]
    flags += ["--max-root-children", str(config.max_children)]
    records = []
    with (
        sidecar_server(work, work / "sidecar.log", config.timeout, tokens, flags) as sidecar,
        SidecarClient(
            sidecar, timeout=config.timeout, auth=ClientAuth(token_file=tokens.file(Role.TRAINER))
        ) as trainer,
        receivers(config, sidecar, tokens) as conns,
    ):
        trainer.register_trainer(TrainerLayout(), config.slots, owner="benchmark")
        agent = "trainer-rank0"
        cpu_start = 0.0
        for index in range(config.warmup + config.versions):
            version = index + 1
            if index == config.warmup:
                cpu_start = _cpu_seconds(work)
            trainer.reserve_slot(version)
            for conn in conns:
                conn.send(version)
            for conn in conns:
                assert conn.recv() == "parked"
            time.sleep(0.05)  # the calls reach the sidecar and wait there
            # Built ahead, as a trainer rank does (`publication.py`): the call alone is timed.
            report = publish_request(version, 0, trainer_part(config, version, agent))
            report.generation = trainer.generation
            start = time.monotonic()
            assert trainer.send_publication(report)
            published = time.monotonic()
            answers = [conn.recv() for conn in conns]
            latencies = sorted(arrived - start for arrived, _ in answers)
            records.append(
                dict(
                    version=version,
                    warmup=index < config.warmup,
                    publish_s=published - start,
                    latencies_s=latencies,
                    sources=[s for _, s in answers],
                )
            )
            log.info(
                "version %d%s: report %.2f ms; answers %s ms after it was sent",
                version,
                " (warm-up)" if index < config.warmup else "",
                1e3 * (published - start),
                [round(1e3 * t, 2) for t in latencies],
            )
        cpu_s = _cpu_seconds(work) - cpu_start
        auth = ClientAuth(token_file=tokens.file(Role.RECEIVER))
        with SidecarClient(sidecar, timeout=config.timeout, auth=auth) as client:
            calls = empty_calls(client, lambda: _cpu_seconds(work))
    timed = [r for r in records if not r["warmup"]]
    ranks = list(zip(*(r["latencies_s"] for r in timed), strict=True))
    summary = dict(
        tensors=len(tensors(config)),
        report_s=statistics.median(r["publish_s"] for r in timed),
        answers_s=[statistics.median(col) for col in ranks],
        sidecar_cpu_s_per_version=cpu_s / len(timed),
        **calls,
        **in_process(config),
    )
    return dict(
        config={k: str(v) for k, v in asdict(config).items()}, summary=summary, records=records
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.sidecar_control",
        description="The sidecar's answers to parked receivers after a version's last report.",
    )
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64, help="tensor sizes (no bytes move)")
    p.add_argument("--experts", type=int, default=0, help="experts per layer (0: dense MLPs)")
    p.add_argument(
        "--expert-layout",
        type=ExpertLayout,
        choices=list(ExpertLayout),
        default=ExpertLayout.PER_EXPERT,
        help="per-expert: two tensors per expert; grouped: one per layer and projection",
    )
    p.add_argument("--receivers", type=int, default=3)
    p.add_argument("--max-children", type=int, default=1, help="the sidecar's tree fan-out")
    p.add_argument("--direct", action="store_true", help="AcquireLease, no tree")
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--versions", type=int, default=30)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--out", type=Path)
    return p


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [bench] %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    config = Config(**{k.replace("-", "_"): v for k, v in vars(args).items()})
    with tempfile.TemporaryDirectory(prefix="sidecar-control-") as tmp:
        result = run(config, Path(tmp))
    summary = result["summary"]
    print(
        f"\n{summary['tensors']} tensors, {config.receivers} receivers "
        f"({'direct' if config.direct else f'tree, max children {config.max_children}'}); "
        f"medians: report {1e3 * summary['report_s']:.2f} ms; answers "
        + ", ".join(f"{1e3 * t:.2f}" for t in summary["answers_s"])
        + " ms after it was sent; the sidecar's CPU "
        + f"{1e3 * summary['sidecar_cpu_s_per_version']:.2f}"
        " ms per version\n"
        f"in-process (no gRPC): publication {1e3 * summary['in_process_publication_s']:.2f} ms, "
        f"an answer {1e3 * summary['in_process_answer_s']:.2f} ms, "
        f"a receiver's plan {1e3 * summary['in_process_plan_s']:.2f} ms"
        + (
            f", a vLLM worker's plan {1e3 * summary['in_process_worker_plan_s']:.2f} ms"
            if "in_process_worker_plan_s" in summary
            else ""
        )
        + "\n"
        f"an empty call: {1e3 * summary['empty_call_s']:.3f} ms back to back, "
        f"{1e3 * summary['empty_call_after_idle_s']:.3f} ms after 50 ms idle; "
        f"the sidecar's CPU {1e3 * summary['empty_call_cpu_s']:.3f} ms"
    )
    if config.out is not None:
        config.out.parent.mkdir(parents=True, exist_ok=True)
        config.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
