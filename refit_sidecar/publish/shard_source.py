"""The source side of a pull: a rank's shards in one arena, registered with NIXL once.

A `ShardSource` lays every shard it serves out in one aligned arena (`arena.Arena`: host DRAM by
default, or any arena the caller allocates, such as a `tensor_arena.TorchArena` in VRAM),
registers it with a NIXL agent when it is built, and is refreshed in place (`write` or `view`
for host memory, device copies into the arena for device memory); the registration, and with it
the agent metadata, stays valid across refreshes. `manifest(version)` describes the current
contents. Leases and double buffering (never overwrite a version a receiver still reads) belong
to the sidecar.

A `SourceAgent` is the NIXL agent with its progress thread. Sources may share one: a trainer
rank's snapshot slots do, so a puller loads the rank's metadata and wires up to it once,
whichever slot it reads, and the rank runs one progress thread, not one per slot.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

from refit_sidecar.core.manifest import (
    AgentRecord,
    Manifest,
    MemType,
    ParameterRecord,
    ShardLocation,
    ShardRecord,
)
from refit_sidecar.core.network import NixlNetwork, ProgressPoller, create_ucx_backend
from refit_sidecar.integrity.checksum import host_checksums
from refit_sidecar.integrity.wsum import SumPlan
from refit_sidecar.memory.host_arena import Arena, HostArena
from refit_sidecar.publish.shard_specs import ShardSpec

Allocator = Callable[[int, int], Arena]
"""(nbytes, alignment) -> an arena of exactly nbytes whose address is aligned."""


@dataclass(frozen=True, kw_only=True)
class SourceConfig:
    name: str
    """NIXL agent name; unique among all sources and pullers."""
    listen_port: int | None = None
    """Serve agent metadata on this port so pullers can fetch it; None: no listener."""
    host: str = "127.0.0.1"
    """An address of the network interface the source's NIXL (UCX) endpoints listen on, and
    advertise with the listener port when there is one (`network.NixlNetwork`; 0.0.0.0:
    every interface). The default keeps a source reachable from its own host only."""
    net_devices: tuple[str, ...] = ()
    """RDMA ports (``mlx5_0:1``) the endpoints may use besides the interface of `host`."""
    alignment: int = 256
    """Byte alignment of each shard in the arena."""
    rank: int = 0
    """Global trainer rank this source serves (recorded in the manifest, as the next two)."""
    tensor_rank: int = 0
    pipeline_stage: int = 0
    progress_poll_s: float | None = 0.01
    """How the agent's UCX worker is progressed (a puller's endpoint wire-up needs the target
    to progress, seen on shared memory here; the reads themselves are one-sided): by a thread
    polling it every `progress_poll_s` seconds, or, with None, by NIXL's progress thread,
    which yields in a tight loop and so takes a core's share on a small machine. Each poll
    takes the GIL from the trainer for a moment; only a puller's first connection waits for
    it (a few polls), so the default leans towards the trainer."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a source needs an agent name")
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {self.alignment}")
        if self.progress_poll_s is not None and not self.progress_poll_s > 0:
            raise ValueError(f"progress_poll_s must be positive, got {self.progress_poll_s}")
        NixlNetwork(host=self.host, extra_devices=self.net_devices)  # raises for bad values

    @property
    def network(self) -> NixlNetwork:
        return NixlNetwork(host=self.host, extra_devices=self.net_devices)


def arena_offsets(specs: Sequence[ShardSpec], alignment: int) -> tuple[dict[str, int], int]:
    """Each shard's byte offset in the arena (aligned, in spec order) and the arena size."""
    offsets, size = {}, 0
    for spec in specs:
        offsets[spec.parameter] = size
        size = -(-(size + spec.nbytes) // alignment) * alignment
    return offsets, size


class SourceAgent:
    """A NIXL agent serving registered memory to pullers, with its progress thread."""

    def __init__(self, config: SourceConfig, agent: nixl_agent) -> None:
        self.config = config
        self.agent = agent
        self._record: AgentRecord | None = None
        self._progress = (
            None
            if config.progress_poll_s is None
            else ProgressPoller(agent, config.name, config.progress_poll_s)
        )

    @classmethod
    def create(cls, config: SourceConfig) -> SourceAgent:
        agent = nixl_agent(
            config.name,
            nixl_agent_config(
                enable_prog_thread=config.progress_poll_s is None,
                enable_listen_thread=config.listen_port is not None,
                listen_port=config.listen_port or 0,
                backends=[],
                sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
            ),
        )
        create_ucx_backend(agent, config.network)
        return cls(config, agent)

    def register(self, arena: Arena) -> Any:
        """Registers the arena's memory; returns the handle `deregister` takes."""
        self._record = None
        return self.agent.register_memory(
            [(arena.address, arena.nbytes, arena.device_id, "")], arena.mem_type.value
        )

    def deregister(self, registration: Any) -> None:
        self._record = None
        self.agent.deregister_memory(registration)

    def record(self) -> AgentRecord:
        """The agent as a manifest lists it; its metadata covers the memory registered so far,
        so take it after the last registration."""
        if self._record is None:
            config = self.config
            self._record = AgentRecord(
                config.name,
                self.agent.get_agent_metadata(),
                config.host if config.listen_port is not None else "",
                config.listen_port,
                config.rank,
            )
        return self._record

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


class ShardSource:
    def __init__(
        self,
        *,
        config: SourceConfig,
        agent: SourceAgent,
        arena: Arena,
        specs: dict[str, ShardSpec],
        offsets: dict[str, int],
        registration: Any,
        owns_agent: bool = False,
    ) -> None:
        self.config = config
        self.agent = agent
        self.arena = arena
        self._specs = specs
        self._offsets = offsets
        self._registration = registration
        self._owns_agent = owns_agent

    @classmethod
    def create(
        cls,
        config: SourceConfig,
        specs: Sequence[ShardSpec],
        allocate: Allocator = HostArena.allocate,
        agent: SourceAgent | None = None,
        layout: tuple[dict[str, int], int] | None = None,
    ) -> ShardSource:
        """A source of `specs` in a new arena, registered with `agent` (None: an agent of its
        own, named by `config`, closed with the source). `layout`: each shard's byte offset
        and the arena size (None: `arena_offsets`, shards back to back)."""
        by_name = {s.parameter: s for s in specs}
        if len(by_name) != len(specs) or not specs:
            raise ValueError("a source serves one shard per parameter, and at least one")
        offsets, size = arena_offsets(specs, config.alignment) if layout is None else layout
        if set(offsets) != set(by_name) or any(
            not 0 <= offsets[n] <= size - by_name[n].nbytes for n in by_name
        ):
            raise ValueError("the layout must place every shard inside the arena")
        arena = allocate(size, config.alignment)
        if arena.nbytes != size or arena.address % config.alignment:
            raise ValueError(f"the allocator gave {arena.nbytes} bytes at {arena.address:#x}")
        owns_agent = agent is None
        if agent is None:
            agent = SourceAgent.create(config)
        return cls(
            config=config,
            agent=agent,
            arena=arena,
            specs=by_name,
            offsets=offsets,
            registration=agent.register(arena),
            owns_agent=owns_agent,
        )

    @property
    def parameters(self) -> tuple[str, ...]:
        return tuple(self._specs)

    def offset(self, parameter: str) -> int:
        """Where the shard starts in the arena, in bytes."""
        return self._offsets[parameter]

    def view(self, parameter: str) -> np.ndarray:
        """The shard's bytes (C order, writable, no copy); host (DRAM) arenas only."""
        return self.arena.host_view(self._offsets[parameter], self._specs[parameter].nbytes)

    def write(self, parameter: str, data: np.ndarray | bytes) -> None:
        view = self.view(parameter)
        raw = np.frombuffer(data, np.uint8) if isinstance(data, bytes) else data
        raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        if raw.nbytes != view.nbytes:
            raise ValueError(f"{parameter}: got {raw.nbytes} bytes for a {view.nbytes}-byte shard")
        view[:] = raw

    @functools.cached_property
    def _records(self) -> tuple[ParameterRecord, ...]:
        """Every shard's record without a checksum: only checksums change between versions."""
        arena, cfg = self.arena, self.config
        records = []
        for name, spec in self._specs.items():
            location = ShardLocation.contiguous(
                agent=self.agent.config.name,
                address=arena.address + self._offsets[name],
                shape=spec.local_shape,
                itemsize=spec.dtype.itemsize,
                mem_type=arena.mem_type,
                device_id=arena.device_id,
            )
            shard = ShardRecord(
                location,
                spec.pieces,
                rank=cfg.rank,
                tensor_rank=cfg.tensor_rank,
                pipeline_stage=cfg.pipeline_stage,
                expert_rank=spec.expert_rank,
                expert_tensor_rank=spec.expert_tensor_rank,
            )
            records.append(ParameterRecord(name, spec.shape, spec.dtype, (shard,)))
        return tuple(records)

    def manifest(self, version: int, *, checksums: bool | None = None) -> Manifest:
        """The current contents as `version`. Checksums (None: when the arena is host memory):
        the CRC-32 and the WSUM-64 of each shard of a host arena; the WSUM-64 of each shard of
        a torch arena in device memory, computed on its device (`device_sums`); ValueError for
        other arenas."""
        if checksums is None:
            checksums = self.arena.mem_type is MemType.DRAM
        records = self._records
        if checksums and self.arena.mem_type is MemType.DRAM:
            records = tuple(
                replace(
                    r, shards=(replace(r.shards[0], **host_checksums(self.view(r.name))._asdict()),)
                )
                for r in records
            )
        elif checksums:
            sums = self.device_sums()
            records = tuple(
                replace(r, shards=(replace(r.shards[0], sum64=value),))
                for r, value in zip(records, sums, strict=True)
            )
        agent = self.agent.record()
        return Manifest(version, records, {agent.name: agent})

    def device_sums(self) -> list[int]:
        """The WSUM-64 of each shard, in `parameters` order, computed where a torch arena's
        memory is (one kernel over the arena on a GPU, on the current stream)."""
        tensor = getattr(self.arena, "tensor", None)
        if tensor is None:
            raise ValueError("only a torch arena's device memory can be checksummed in place")
        from refit_sidecar.integrity.device_sums import group_sums  # a torch arena: torch is there

        return group_sums(tensor, self._sum_plan).tolist()  # Python ints, as uint64 holds them

    @functools.cached_property
    def _sum_plan(self) -> SumPlan:
        names = list(self._specs)
        count = len(names)
        return SumPlan.of(
            [self._offsets[n] for n in names],
            [self._specs[n].nbytes for n in names],
            [0] * count,
            list(range(count)),
            count,
        )

    def close(self) -> None:
        if self._registration is not None:
            self.agent.deregister(self._registration)
            self._registration = None
        if self._owns_agent:
            self.agent.close()
