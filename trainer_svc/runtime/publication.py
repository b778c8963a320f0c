"""This rank's side of refit publication: its own Megatron shards, never gathered, copied after
each new version (a finished step, a loaded checkpoint) into one of ``slots`` NIXL-registered
snapshot arenas (registered once, at start) and reported to the sidecar, which makes the version
readable once every rank reported.

The arenas live where the parameters do: VRAM on a GPU, so a snapshot is a device-local copy on
a side stream and no byte crosses to the host; DRAM on the CPU. CRC-32s are computed (on the
host) only for DRAM slots: a device slot publishes none (see docs/refit.md).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from megatron_hf.sharding import tp_placement
from megatron_hf.spec import ModelSpec
from refit_sidecar.client import SidecarClient, TrainerLayout
from refit_sidecar.layout import ShardSpec, placement_spec
from refit_sidecar.manifest import DType
from refit_sidecar.source import ShardSource, SourceConfig
from refit_sidecar.torch_arena import TorchArena
from trainer_svc.runtime.topology import Topology
from trainer_svc.runtime.weights import local_parameters

log = logging.getLogger(__name__)

_DTYPES = {
    torch.float32: DType.FLOAT32,
    torch.bfloat16: DType.BFLOAT16,
    torch.float16: DType.FLOAT16,
}


def _global_shape(name: str, local: torch.Size, tp_size: int) -> tuple[int, ...]:
    dim = tp_placement(name).dim
    return tuple(n * tp_size if d == dim else n for d, n in enumerate(local))


def published_parameters(
    model: torch.nn.Module, spec: ModelSpec, topology: Topology
) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters by global name; a tied output layer is not published twice."""
    return {
        name: param
        for name, param in local_parameters(model, spec, topology).items()
        if not (name == "output_layer.weight" and spec.tie_word_embeddings)
    }


def shard_specs(parameters: dict[str, torch.nn.Parameter], topology: Topology) -> list[ShardSpec]:
    tp = topology.layout.tensor_parallel
    return [
        placement_spec(
            name,
            tp_placement(name),
            _global_shape(name, param.shape, tp),
            _DTYPES[param.dtype],
            tp_rank=topology.tp_rank,
            tp_size=tp,
        )
        for name, param in parameters.items()
    ]


@dataclass(frozen=True)
class Slot:
    source: ShardSource
    views: dict[str, torch.Tensor]
    """Per parameter, a view of the arena with the parameter's dtype and shape."""


def create_slot(
    config: SourceConfig,
    specs: list[ShardSpec],
    parameters: dict[str, torch.nn.Parameter],
    device: torch.device,
) -> Slot:
    source = ShardSource.create(
        config, specs, functools.partial(TorchArena.allocate, device=device)
    )
    arena = source.arena
    assert isinstance(arena, TorchArena)
    views = {
        name: arena.tensor_view(source.offset(name), param.dtype, param.shape)
        for name, param in parameters.items()
    }
    return Slot(source, views)


@dataclass
class Publisher:
    client: SidecarClient
    slots: list[Slot]
    parameters: dict[str, torch.nn.Parameter]
    topology: Topology
    device: torch.device
    stream: torch.cuda.Stream | None = None
    """The side stream of the device copies (CUDA only)."""

    @classmethod
    def create(
        cls,
        model: torch.nn.Module,
        spec: ModelSpec,
        topology: Topology,
        *,
        sidecar: str,
        slots: int,
        device: torch.device,
    ) -> Publisher:
        parameters = published_parameters(model, spec, topology)
        specs = shard_specs(parameters, topology)
        built = [
            create_slot(
                SourceConfig(
                    name=f"trainer-rank{topology.rank}-slot{slot}",
                    rank=topology.rank,
                    tensor_rank=topology.tp_rank,
                    pipeline_stage=topology.pp_rank,
                ),
                specs,
                parameters,
                device,
            )
            for slot in range(slots)
        ]
        client = SidecarClient(sidecar)
        if topology.is_leader:
            client.wait_ready()
            layout = topology.layout
            client.register_trainer(
                TrainerLayout(
                    tensor_parallel=layout.tensor_parallel,
                    pipeline_parallel=layout.pipeline_parallel,
                    data_parallel=layout.data_parallel,
                ),
                slots,
            )
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        publisher = cls(client, built, parameters, topology, device, stream)
        arena = built[0].source.arena
        log.info(
            "refit: %d snapshot slots of %d bytes each in %s (device %d)",
            slots,
            arena.nbytes,
            arena.mem_type.value,
            arena.device_id,
        )
        return publisher

    @property
    def snapshot_bytes(self) -> int:
        """Memory this rank's slots take (host or device, where the parameters are)."""
        return sum(slot.source.arena.nbytes for slot in self.slots)

    def reserve(self, version: int) -> int:
        """Rank 0, before the weights change: the slot the new version goes to."""
        slot, retired = self.client.reserve_slot(version)
        if retired is not None:
            log.info("refit: version %d retired to make room for %d", retired, version)
        return slot

    @torch.no_grad()
    def snapshot(self, slot: int) -> None:
        """Copies the parameters into the slot; returns once the copies are complete."""
        views = self.slots[slot].views
        stream = self.stream
        if stream is None:
            for name, param in self.parameters.items():
                views[name].copy_(param)
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for name, param in self.parameters.items():
                views[name].copy_(param, non_blocking=True)
        stream.synchronize()

    def publish(self, version: int, slot: int) -> None:
        self.snapshot(slot)
        source = self.slots[slot].source
        self.client.publish(version, self.topology.rank, source.manifest(version))

    def close(self) -> None:
        for slot in self.slots:
            slot.source.close()
        self.client.close()
