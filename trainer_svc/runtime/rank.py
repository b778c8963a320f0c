"""One rank's life: join the process group, build the model and engine, then serve or follow."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_hf.spec import ModelSpec, padded_vocab_size
from trainer_refit.serving import wait_for_stop_signal, write_port_file
from trainer_svc.config import CudaGraphs, Device, ReferenceWeights, TrainerConfig
from trainer_svc.runtime import commands as cmd
from trainer_svc.runtime import cpu_compat, determinism, documents, host_memory, layer_graphs
from trainer_svc.runtime.checkpointing import Checkpointer
from trainer_svc.runtime.control import Leader, follow
from trainer_svc.runtime.engine import StepEngine
from trainer_svc.runtime.liveness import LeaderLink, PeerLost, reachable_host
from trainer_svc.runtime.liveness_monitor import PeerMonitor
from trainer_svc.runtime.model_factory import build_model, wrap_for_training
from trainer_svc.runtime.param_buffers import pack_parameters
from trainer_svc.runtime.passes import derived_budget
from trainer_svc.runtime.path_roots import PathRoots
from trainer_svc.runtime.publication import Publisher
from trainer_svc.runtime.reference_policy import ReferencePolicy
from trainer_svc.runtime.snapshot_slot import published_parameters, published_tensors
from trainer_svc.runtime.topology import Topology
from trainer_svc.runtime.weights import load_hf_weights
from trainer_svc.server.app import create_server
from trainer_svc.server.publication_health import watch_publication
from trainer_svc.server.status import ServiceInfo
from trainer_svc.validation import BatchLimits

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RankIdentity:
    """Deployment identity, from the torchrun-compatible environment (read here only)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls) -> RankIdentity | None:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return None
        return cls(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
            master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(os.environ.get("MASTER_PORT", "29500")),
        )


def _device(config: TrainerConfig, identity: RankIdentity) -> torch.device:
    determinism.apply(config.model.deterministic)  # before any CUDA work
    use_cuda = config.device is Device.CUDA or (
        config.device is Device.AUTO and torch.cuda.is_available()
    )
    if use_cuda:
        torch.cuda.set_device(identity.local_rank)
        return torch.device("cuda", identity.local_rank)
    return torch.device("cpu")


def _join_world(config: TrainerConfig, identity: RankIdentity, device: torch.device) -> None:
    layout = config.layout
    if identity.world_size != layout.world_size:
        raise ValueError(
            f"the environment has {identity.world_size} ranks but {layout.describe()} needs "
            f"{layout.world_size}"
        )
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{identity.master_addr}:{identity.master_port}",
        rank=identity.rank,
        world_size=identity.world_size,
        timeout=timedelta(minutes=30),
    )


def _watch_world(config: TrainerConfig, identity: RankIdentity) -> PeerMonitor | LeaderLink:
    """Starts this rank's side of the liveness links (`runtime/liveness.py`): rank 0 listens
    and broadcasts its address, the others connect to it. Rank 0 starts its clock only once
    every rank has reached the broadcast (ranks on other nodes may start much later)."""
    monitor: PeerMonitor | None = None
    box: list[tuple[str, int] | None] = [None]
    if identity.rank == 0:
        host = reachable_host(identity.master_addr, identity.master_port)
        monitor = PeerMonitor.listen(config.liveness, world_size=identity.world_size, host=host)
        box = [monitor.address]
    dist.broadcast_object_list(box, src=0)
    if monitor is not None:
        monitor.start()
        return monitor
    address = box[0]
    assert address is not None
    return LeaderLink.connect(config.liveness, rank=identity.rank, address=address)


def _init_model_parallel(config: TrainerConfig, device: torch.device) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    layout = config.layout
    if device.type == "cpu":
        cpu_compat.install()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor_parallel,
        pipeline_model_parallel_size=layout.pipeline_parallel,
        expert_model_parallel_size=layout.expert_parallel,
        expert_tensor_parallel_size=layout.expert_tensor_parallel,
    )
    torch.manual_seed(config.seed)
    model_parallel_cuda_manual_seed(config.seed)


def _load_weights(
    model: torch.nn.Module, model_dir: Path, spec: ModelSpec, topology: Topology, padded: int
) -> None:
    baseline = host_memory.reset_peak()
    start = time.monotonic()
    report = load_hf_weights(model, model_dir, spec, topology, padded)
    mib = 1 << 20
    # benchmarks/checkpoint_io.py reads this line.
    log.info(
        "loaded HF weights from %s: read %.1f MiB for a share of %.1f MiB in %.2f s, "
        "host memory peak +%.1f MiB",
        model_dir,
        report.bytes_read / mib,
        report.share_bytes / mib,
        time.monotonic() - start,
        max(0, host_memory.peak_bytes() - baseline) / mib,
    )


def build_engine(
    config: TrainerConfig, model_dir: Path, device: torch.device
) -> tuple[StepEngine, ServiceInfo]:
    spec = ModelSpec.from_pretrained_dir(model_dir)
    if config.model.cuda_graphs is CudaGraphs.LAYERS:
        refused = layer_graphs.refusal(
            on_gpu=device.type == "cuda",
            tensor_parallel=config.layout.tensor_parallel,
            pipeline_parallel=config.layout.pipeline_parallel,
            moe=spec.is_moe,
        )
        if refused is not None:
            raise ValueError(refused)
    topology = Topology.from_parallel_state(config.layout)
    padded = padded_vocab_size(
        spec.vocab_size, config.layout.tensor_parallel, config.model.vocab_multiple
    )
    max_len = config.model.max_sequence_length or spec.max_position_embeddings
    with cpu_compat.active():
        model, transformer_config = build_model(
            spec,
            topology,
            padded_vocab=padded,
            max_sequence_length=max_len,
            params_dtype=config.model.params_dtype,
            on_gpu=device.type == "cuda",
            attention=config.model.attention,
            recompute=config.model.recompute,
            deterministic=config.model.deterministic,
        )
        layout = documents.resolve(
            config.model.sequence_layout, model, config.model.packed_attention
        )
        log.info(
            "sequence layout: %s (packed attention: %s)",
            layout.value,
            config.model.packed_attention.value,
        )
        if any(model_dir.glob("*.safetensors")):
            _load_weights(model, model_dir, spec, topology, padded)
        if config.refit.sidecar is not None:
            # A layer's experts back to back, in expert order: a snapshot copies them at once.
            tensors = published_tensors(model, spec, topology)
            pack_parameters(published_parameters(tensors).values())
        built = wrap_for_training(
            model, transformer_config, topology, config.optimizer, config.model.experts
        )
        if config.model.cuda_graphs is CudaGraphs.LAYERS:
            layer_graphs.install(model.decoder.layers)
        reference = None
        if config.reference.weights is ReferenceWeights.INITIAL:
            reference = ReferencePolicy(model, config.reference.placement)
            log.info(
                "reference policy: the start-up weights, %.1f MiB in %s memory",
                reference.nbytes / 2**20,
                config.reference.placement.value,
            )
    publisher = None
    if config.refit.sidecar is not None:
        publisher = Publisher.create(
            model,
            spec,
            topology,
            sidecar=config.refit.sidecar,
            auth=config.refit.auth,
            slots=config.refit.slots,
            device=device,
            nixl_host=config.refit.nixl_host,
            nixl_net_devices=config.refit.nixl_net_devices,
            first_piece_bytes=config.refit.first_piece_bytes,
            every=config.refit.publish_every,
            take_over=config.refit.take_over,
            report_deadline_s=config.refit.report_deadline_s,
        )
    snapshot_bytes = publisher.snapshot_bytes if publisher else 0
    # The smallest budget of any rank, so the ranks of a replica cut a request alike.
    budget = torch.tensor(
        [
            config.server.pass_token_budget
            or derived_budget(
                spec,
                layers=len(model.decoder.layers),
                local_vocab=padded // config.layout.tensor_parallel,
                dtype=transformer_config.params_dtype,
                device=device,
                max_tokens=config.server.max_microbatch_tokens,
            )
        ],
        dtype=torch.int64,
    )
    dist.all_reduce(budget, op=dist.ReduceOp.MIN, group=topology.control_group)
    local = torch.tensor(
        [
            sum(p.numel() for p in model.parameters()) if topology.dp_rank == 0 else 0,
            snapshot_bytes,
        ],
        dtype=torch.int64,
    )
    dist.all_reduce(local, group=topology.control_group)
    engine = StepEngine(
        built=built,
        spec=spec,
        topology=topology,
        limits=BatchLimits(
            vocab_size=spec.vocab_size,
            max_sequence_length=max_len,
            max_tokens=config.server.max_microbatch_tokens,
        ),
        optimizer_defaults=config.optimizer,
        padded_vocab=padded,
        device=device,
        checkpointer=Checkpointer(model_dir, PathRoots.resolved(config.checkpoint_roots())),
        publisher=publisher,
        pass_tokens=int(budget[0]),
        layout=layout,
        reference=reference,
    )
    info = ServiceInfo(
        spec=spec,
        padded_vocab=padded,
        num_parameters=int(local[0]),
        params_dtype=config.model.params_dtype,
        max_sequence_length=max_len,
        sidecar=config.refit.sidecar or "",
        refit_snapshot_bytes=int(local[1]),
        pass_token_budget=int(budget[0]),
        sequence_layout=layout.value,
        reference_policy=config.reference.weights.value,
        reference_placement=config.reference.placement.value if reference is not None else "",
    )
    return engine, info


async def _serve(
    engine: StepEngine, info: ServiceInfo, config: TrainerConfig, monitor: PeerMonitor
) -> None:
    leader = Leader(engine)
    if config.refit.publish_start and engine.publisher is not None:
        await _publish_start(leader)
    running = await create_server(leader, info, config.server)
    lost = _lost_rank(monitor)
    log.info(
        "trainer serving gRPC on %s:%d, %s",
        config.server.host,
        running.port,
        config.layout.describe(),
    )
    write_port_file(config.server.port_file, running.port)
    watcher = None
    if engine.publisher is not None:
        watcher = asyncio.create_task(watch_publication(running.health, engine.publisher))
    stop = asyncio.ensure_future(wait_for_stop_signal())
    await asyncio.wait((stop, lost), return_when=asyncio.FIRST_COMPLETED)
    if watcher is not None:
        watcher.cancel()
    if lost.done():
        # Every call answers UNAVAILABLE naming the rank until the monitor ends the process.
        stop.cancel()
        leader.world_lost(str(lost.result()))
        await running.health.enter_graceful_shutdown()
        await asyncio.Event().wait()
    lost.cancel()
    log.info("shutting down (%s)", stop.result().name)
    await running.stop(config.server.grace_seconds)
    await leader.shutdown()


async def _publish_start(leader: Leader) -> None:
    """The start-up weights as version 1, before any request can come; a failure (the sidecar
    unreachable) leaves the trainer serving at version 0, as without the setting."""
    try:
        version = await leader.submit(cmd.PublishStart())
    except Exception as e:
        log.warning("refit: the start-up weights are not published: %s", e)
    else:
        log.info("refit: the start-up weights are version %d", version)


def _lost_rank(monitor: PeerMonitor) -> asyncio.Future[PeerLost]:
    """A future of the event loop that the monitor's thread resolves when a rank is lost."""
    loop = asyncio.get_running_loop()
    lost: asyncio.Future[PeerLost] = loop.create_future()

    def resolve(loss: PeerLost) -> None:
        if not lost.done():
            lost.set_result(loss)

    def notify(loss: PeerLost) -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(resolve, loss)

    monitor.add_listener(notify)
    return lost


_NOTICE_SECONDS = 2.0
"""How long a rank whose command loop failed waits for its liveness link to name rank 0's
loss (a dead rank 0 first shows as a collective's error) before failing with that error."""


def run_rank(config: TrainerConfig, identity: RankIdentity, model_dir: Path) -> None:
    device = _device(config, identity)
    _join_world(config, identity, device)
    liveness = _watch_world(config, identity)
    _init_model_parallel(config, device)
    engine, info = build_engine(config, model_dir, device)
    if isinstance(liveness, PeerMonitor):
        asyncio.run(_serve(engine, info, config, liveness))
    else:
        # Rank 0 coordinates shutdown; an interrupt here would strand it in a collective.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            follow(engine)
        except Exception:
            liveness.await_loss(_NOTICE_SECONDS)
            raise
    # Every rank finished the Shutdown command: from here on, a rank leaving is no loss.
    liveness.close()
    if engine.publisher is not None:
        engine.publisher.close()
    dist.destroy_process_group()
