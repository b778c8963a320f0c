"""The source side of a pull: host buffers for a rank's shards, registered with NIXL once.

A `ShardSource` owns one aligned DRAM arena holding every shard it serves, registers it with its
own NIXL agent when it is built, and is refreshed in place (`write`, or `view` for writers such
as `torch.from_numpy(view).copy_(param)`); the registration, and with it the agent metadata,
stays valid across refreshes. `manifest(version)` describes the current contents. Leases and
double buffering (never overwrite a version a receiver still reads) belong to the sidecar.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config

from refit_sidecar.checksum import checksum
from refit_sidecar.layout import ShardSpec
from refit_sidecar.manifest import (
    AgentRecord,
    Manifest,
    ParameterRecord,
    ShardLocation,
    ShardRecord,
)


@dataclass(frozen=True, kw_only=True)
class SourceConfig:
    name: str
    """NIXL agent name; unique among all sources and pullers."""
    listen_port: int | None = None
    """Serve agent metadata on this port so pullers can fetch it; None: no listener."""
    host: str = "127.0.0.1"
    """Address advertised with the listener port."""
    alignment: int = 256
    """Byte alignment of each shard in the arena."""
    rank: int = 0
    """Global trainer rank this source serves (recorded in the manifest, as the next two)."""
    tensor_rank: int = 0
    pipeline_stage: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a source needs an agent name")
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {self.alignment}")


class ShardSource:
    def __init__(
        self,
        *,
        config: SourceConfig,
        agent: nixl_agent,
        arena: np.ndarray,
        specs: dict[str, ShardSpec],
        offsets: dict[str, int],
        registration: Any,
    ) -> None:
        self.config = config
        self._agent = agent
        self._arena = arena
        self._specs = specs
        self._offsets = offsets
        self._registration = registration

    @classmethod
    def create(cls, config: SourceConfig, specs: Sequence[ShardSpec]) -> ShardSource:
        by_name = {s.parameter: s for s in specs}
        if len(by_name) != len(specs) or not specs:
            raise ValueError("a source serves one shard per parameter, and at least one")
        offsets, size = {}, 0
        for spec in specs:
            offsets[spec.parameter] = size
            size = -(-(size + spec.nbytes) // config.alignment) * config.alignment
        raw = np.zeros(size + config.alignment, np.uint8)
        skip = -raw.ctypes.data % config.alignment
        arena = raw[skip : skip + size]
        agent = nixl_agent(
            config.name,
            nixl_agent_config(
                enable_listen_thread=config.listen_port is not None,
                listen_port=config.listen_port or 0,
                backends=[],
            ),
        )
        agent.create_backend("UCX", {"ucx_error_handling_mode": "peer"})
        registration = agent.register_memory([(arena.ctypes.data, arena.nbytes, 0, "")], "DRAM")
        return cls(
            config=config,
            agent=agent,
            arena=arena,
            specs=by_name,
            offsets=offsets,
            registration=registration,
        )

    @property
    def parameters(self) -> tuple[str, ...]:
        return tuple(self._specs)

    def view(self, parameter: str) -> np.ndarray:
        """The shard's bytes (C order, writable, no copy)."""
        spec = self._specs[parameter]
        start = self._offsets[parameter]
        return self._arena[start : start + spec.nbytes]

    def write(self, parameter: str, data: np.ndarray | bytes) -> None:
        view = self.view(parameter)
        raw = np.frombuffer(data, np.uint8) if isinstance(data, bytes) else data
        raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        if raw.nbytes != view.nbytes:
            raise ValueError(f"{parameter}: got {raw.nbytes} bytes for a {view.nbytes}-byte shard")
        view[:] = raw

    def agent_record(self) -> AgentRecord:
        return AgentRecord(
            self.config.name,
            self._agent.get_agent_metadata(),
            self.config.host if self.config.listen_port is not None else "",
            self.config.listen_port,
            self.config.rank,
        )

    def manifest(self, version: int, *, checksums: bool = True) -> Manifest:
        records = []
        for name, spec in self._specs.items():
            location = ShardLocation.contiguous(
                agent=self.config.name,
                address=self._arena.ctypes.data + self._offsets[name],
                shape=spec.local_shape,
                itemsize=spec.dtype.itemsize,
            )
            crc = checksum(self.view(name)) if checksums else None
            cfg = self.config
            shard = ShardRecord(
                location, spec.pieces, crc, cfg.rank, cfg.tensor_rank, cfg.pipeline_stage
            )
            records.append(ParameterRecord(name, spec.shape, spec.dtype, (shard,)))
        return Manifest(version, tuple(records), {self.config.name: self.agent_record()})

    def close(self) -> None:
        if self._registration is not None:
            self._agent.deregister_memory(self._registration)
            self._registration = None
