"""This rank's side of refit publication: its own Megatron shards, never gathered, copied after
each optimizer step into one of ``slots`` NIXL-registered snapshot buffers (registered once, at
start) and reported to the sidecar, which makes the version readable once every rank reported.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from megatron_hf.sharding import tp_placement
from megatron_hf.spec import ModelSpec
from refit_sidecar.client import SidecarClient, TrainerLayout
from refit_sidecar.layout import ShardSpec, placement_spec
from refit_sidecar.manifest import DType
from refit_sidecar.source import ShardSource, SourceConfig
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


@dataclass
class Publisher:
    client: SidecarClient
    sources: list[ShardSource]
    parameters: dict[str, torch.nn.Parameter]
    topology: Topology

    @classmethod
    def create(
        cls,
        model: torch.nn.Module,
        spec: ModelSpec,
        topology: Topology,
        *,
        sidecar: str,
        slots: int,
    ) -> Publisher:
        parameters = {
            name: param
            for name, param in local_parameters(model, spec, topology).items()
            if not (name == "output_layer.weight" and spec.tie_word_embeddings)
        }
        tp = topology.layout.tensor_parallel
        specs: list[ShardSpec] = [
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
        sources = [
            ShardSource.create(
                SourceConfig(
                    name=f"trainer-rank{topology.rank}-slot{slot}",
                    rank=topology.rank,
                    tensor_rank=topology.tp_rank,
                    pipeline_stage=topology.pp_rank,
                ),
                specs,
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
        publisher = cls(client, sources, parameters, topology)
        log.info("refit: %d snapshot slots of %d bytes each", slots, publisher.slot_bytes)
        return publisher

    @property
    def slot_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters.values())

    def reserve(self, version: int) -> int:
        """Rank 0, before the optimizer step: the slot the new version goes to."""
        slot, retired = self.client.reserve_slot(version)
        if retired is not None:
            log.info("refit: version %d retired to make room for %d", retired, version)
        return slot

    @torch.no_grad()
    def publish(self, version: int, slot: int) -> None:
        source = self.sources[slot]
        for name, param in self.parameters.items():
            source.write(name, param.detach().reshape(-1).view(torch.uint8).cpu().numpy())
        self.client.publish(version, self.topology.rank, source.manifest(version))

    def close(self) -> None:
        for source in self.sources:
            source.close()
        self.client.close()
