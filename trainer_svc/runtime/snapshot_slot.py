"""A rank's snapshot slots: where each published parameter's bytes go in a slot (one region
per Megatron buffer, copied in pieces), the slot's version words, and its report to the
sidecar, built once per slot so a version only sets its number and checksums. The
`Publisher` (`publication`) copies into them and sends the reports."""

from __future__ import annotations

import functools
import logging
import secrets
from dataclasses import dataclass, replace
from typing import Any

import torch

from megatron_hf.experts import expert_group_of, grouped_expert_shape, parse_grouped_expert_name
from megatron_hf.sharding import tp_placement
from megatron_hf.spec import ModelSpec
from refit_sidecar.core.manifest import VERSION_WORD_BYTES, DType, MemType, ShardLocation
from refit_sidecar.integrity.checksum import host_checksums
from refit_sidecar.memory.tensor_arena import TorchArena
from refit_sidecar.publish.shard_source import ShardSource, SourceAgent, SourceConfig
from refit_sidecar.publish.shard_specs import ShardSpec, expert_group_spec, placement_spec
from refit_sidecar.publish.slot_layout import (
    Group,
    Placement,
    SnapshotLayout,
    cut_into_pieces,
    piece_ends,
    snapshot_layout,
)
from refit_sidecar.service.wire import location_to_proto, publish_request
from trainer_refit.v1 import refit_pb2 as pb
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


@dataclass(frozen=True)
class PublishedTensor:
    """One tensor of a published version as this rank holds it: a parameter, or a layer's
    experts (`members`, this rank's, in expert order) published as one grouped tensor so that
    a receiver plans and reads them as a few boxes, not one tensor per expert."""

    spec: ShardSpec
    members: tuple[torch.nn.Parameter, ...]

    @property
    def name(self) -> str:
        return self.spec.parameter


def published_tensors(
    model: torch.nn.Module, spec: ModelSpec, topology: Topology
) -> list[PublishedTensor]:
    """This rank's published tensors, each where its first parameter is in the model's order;
    a tied output layer is not published twice."""
    tp = topology.layout.tensor_parallel
    out: list[PublishedTensor | None] = []
    experts: dict[str, tuple[int, dict[int, torch.nn.Parameter]]] = {}
    for name, param in local_parameters(model, spec, topology).items():
        if name == "output_layer.weight" and spec.tie_word_embeddings:
            continue
        group = expert_group_of(name)
        if group is not None:
            grouped, expert = group
            if grouped not in experts:
                experts[grouped] = (len(out), {})
                out.append(None)
            experts[grouped][1][expert] = param
            continue
        dense = placement_spec(
            name,
            tp_placement(name),
            _global_shape(name, param.shape, tp),
            _DTYPES[param.dtype],
            tp_rank=topology.tp_rank,
            tp_size=tp,
        )
        out.append(PublishedTensor(dense, (param,)))
    for grouped, (at, members) in experts.items():
        out[at] = _expert_group(grouped, members, spec, topology)
    return [t for t in out if t is not None]


def _expert_group(
    name: str, members: dict[int, torch.nn.Parameter], spec: ModelSpec, topology: Topology
) -> PublishedTensor:
    parsed = parse_grouped_expert_name(name)
    assert parsed is not None
    params = [members[e] for e in sorted(members)]
    group = expert_group_spec(
        name,
        grouped_expert_shape(spec, parsed[1]),
        _DTYPES[params[0].dtype],
        fc=parsed[1],
        ep_rank=topology.ep_rank,
        ep_size=topology.layout.expert_parallel,
        etp_rank=topology.etp_rank,
        etp_size=topology.layout.expert_tensor_parallel,
    )
    first = group.pieces[0].box.ranges[0][0]
    if sorted(members) != list(range(first, first + group.local_shape[0])) or any(
        tuple(p.shape) != group.local_shape[1:] or p.dtype != params[0].dtype for p in params
    ):
        raise ValueError(
            f"{name}: this rank's experts {sorted(members)} of shapes "
            f"{sorted({tuple(p.shape) for p in params})} are not EP rank {topology.ep_rank}'s "
            f"{group.local_shape[0]} experts of {group.local_shape[1:]}"
        )
    return PublishedTensor(group, tuple(params))


def published_parameters(tensors: list[PublishedTensor]) -> dict[str, torch.nn.Parameter]:
    """The parameters behind `tensors` by an identifying name, in publication order (a
    group's members back to back)."""
    return {
        f"{t.name}[{i}]" if len(t.members) > 1 else t.name: member
        for t in tensors
        for i, member in enumerate(t.members)
    }


@dataclass(frozen=True)
class Slot:
    source: ShardSource
    pieces: list[tuple[list[torch.Tensor], list[torch.Tensor]]]
    """Per piece of the snapshot copy (`slot_layout.piece_ends`): the slot bytes and the
    parameter bytes of each part of a layout region that lands in it."""
    report: pb.PublishShardsRequest
    """This rank's report of the slot, built once: a version sets its number (and checksums)."""
    words: torch.Tensor
    words_registration: Any
    """The slot's words (one int64 per piece in registered memory, beside the slot's arena):
    word i holds the number of the version whose bytes piece i holds, written after the
    piece's copy, so a receiver that leased the version before it is readable reads each
    piece behind the copy. The last is the slot's version word: every byte has landed. All
    are 0 from before a copy changes any byte until their piece landed, so a receiver that
    reads its version's word after its reads knows no copy had started under them."""

    @functools.cached_property
    def _live(self) -> tuple[pb.PublishShardsRequest, list[tuple[str, Any]]]:
        """The report as sent, a copy of `report` whose version and checksums each request
        sets, and each of its parameters' name and first (only) shard record. Held once:
        reaching a record through its parameter builds wrappers each time, most of a report's
        Python work, done on the reporter thread while the next step launches its kernels."""
        live = pb.PublishShardsRequest()
        live.CopyFrom(self.report)
        return live, [(p.name, p.shards[0]) for p in live.parameters]

    def request(
        self, version: int, generation: int, stream: torch.cuda.Stream | None = None
    ) -> pb.PublishShardsRequest:
        """The report of `version`, held in this slot, with its checksums: the CRC-32 and the
        WSUM-64 of each shard of a host slot (a receiver that reads part of a shard checks it
        with the engine's other workers through the WSUM-64), the WSUM-64 of each shard of a
        device slot (computed on `stream`, off the trainer's). The slot's one report message,
        rewritten by the next request: send it before asking again (the reporter thread does,
        one at a time)."""
        request, shards = self._live
        request.version = version
        request.generation = generation
        if self.source.arena.mem_type is MemType.DRAM:
            for name, shard in shards:
                shard.crc32, shard.wsum64 = host_checksums(self.source.view(name))
        else:
            with torch.cuda.stream(stream):
                sums = self.source.device_sums()
            for (_, shard), value in zip(shards, sums, strict=True):
                shard.wsum64 = value
        return request


def _storage_bytes(tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Bytes [start, stop) of the tensor's storage as a uint8 tensor (no copy)."""
    view = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return view.set_(tensor.untyped_storage(), start, (stop - start,), (1,))


FOREACH_FROM = 8
"""A piece of this many regions or more is copied in one `_foreach_copy_` (a layer's experts,
one region each where Megatron's buffer keeps them apart); fewer, region by region, each a
device memcpy, the fastest copy of a large region."""
_WIDEST = (torch.int64, torch.int32, torch.int16)


def piece_copies(
    destinations: list[torch.Tensor], sources: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A piece's copies (byte views), each pair viewed in the widest element type every part
    of the piece allows: `_foreach_copy_` moves one element per thread, and a copy of bytes
    runs well below memory speed (tests/gpu/test_expert_snapshot_gpu.py prints both)."""
    if len(destinations) < FOREACH_FROM:
        return destinations, sources
    for dtype in _WIDEST:
        size = torch.empty(0, dtype=dtype).element_size()
        if all(
            t.numel() % size == 0 and t.data_ptr() % size == 0 for t in (*destinations, *sources)
        ):
            return [t.view(dtype) for t in destinations], [t.view(dtype) for t in sources]
    return destinations, sources


def copy_piece(
    destinations: list[torch.Tensor], sources: list[torch.Tensor], *, non_blocking: bool
) -> None:
    """One piece of a snapshot (`piece_copies`)."""
    if len(destinations) < FOREACH_FROM:
        for destination, source in zip(destinations, sources, strict=True):
            destination.copy_(source, non_blocking=non_blocking)
    else:
        torch._foreach_copy_(destinations, sources, non_blocking=non_blocking)


def parameter_layout(
    tensors: list[PublishedTensor], alignment: int
) -> tuple[SnapshotLayout, dict[int, torch.nn.Parameter]]:
    """The slot layout of the tensors (one region per Megatron buffer, and a grouped tensor's
    members back to back), and one parameter of each storage, to reach the storage's
    bytes."""
    placements: list[Placement] = []
    groups: list[Group] = []
    holders: dict[int, torch.nn.Parameter] = {}

    def place(name: str, param: torch.nn.Parameter) -> Placement:
        if not param.is_contiguous():
            raise ValueError(f"{name} is not contiguous; a snapshot copies whole byte ranges")
        storage = param.untyped_storage()
        holders.setdefault(storage.data_ptr(), param)
        start = param.data_ptr() - storage.data_ptr()
        return Placement(name, storage.data_ptr(), start, param.nbytes)

    for tensor in tensors:
        if len(tensor.members) == 1:
            placements.append(place(tensor.name, tensor.members[0]))
        else:
            members = tuple(place(f"{tensor.name}[{i}]", m) for i, m in enumerate(tensor.members))
            groups.append(Group(tensor.name, members))
    return snapshot_layout(placements, alignment, groups=groups), holders


@dataclass(frozen=True)
class _Built:
    source: ShardSource
    pieces: list[tuple[list[torch.Tensor], list[torch.Tensor]]]
    words: TorchArena
    ends: tuple[int, ...]
    registration: Any


def create_slot(
    config: SourceConfig,
    tensors: list[PublishedTensor],
    device: torch.device,
    agent: SourceAgent,
    *,
    first_piece_bytes: int,
) -> _Built:
    """A slot's source, registered with the rank's agent, its copies in pieces, and its words
    (registered too, 0 until a version is copied in) with their registration."""
    layout, holders = parameter_layout(tensors, config.alignment)
    source = ShardSource.create(
        config,
        [t.spec for t in tensors],
        functools.partial(TorchArena.allocate, device=device),
        agent,
        (layout.offsets, layout.nbytes),
    )
    arena = source.arena
    assert isinstance(arena, TorchArena)
    ends = piece_ends(layout.nbytes, first_piece_bytes)
    pieces = [
        piece_copies(
            [arena.tensor_view(p.offset, torch.uint8, torch.Size([p.nbytes])) for p in parts],
            [_storage_bytes(holders[p.storage], p.start, p.stop) for p in parts],
        )
        for parts in cut_into_pieces(layout.regions, ends)
    ]
    words = TorchArena.allocate(len(ends) * VERSION_WORD_BYTES, config.alignment, device=device)
    words.tensor.zero_()
    return _Built(source, pieces, words, ends, agent.register(words))


def with_words(report: pb.PublishShardsRequest, built: _Built) -> None:
    """Names the slot's words in its report's agent: the pieces', and the last as its
    version word."""
    words, name = built.words, report.agent.name
    count = len(built.ends)
    location = ShardLocation.contiguous(
        agent=name,
        address=words.address,
        shape=(count * VERSION_WORD_BYTES,),
        itemsize=1,
        mem_type=words.mem_type,
        device_id=words.device_id,
    )
    last = replace(
        location,
        address=words.address + (count - 1) * VERSION_WORD_BYTES,
        nbytes=VERSION_WORD_BYTES,
        shape=(VERSION_WORD_BYTES,),
    )
    report.agent.version_word.CopyFrom(location_to_proto(last))
    pieces = report.agent.pieces
    pieces.words.CopyFrom(location_to_proto(location))
    pieces.slot_address = built.source.arena.address
    pieces.ends.extend(built.ends)


def build_slots(
    tensors: list[PublishedTensor],
    topology: Topology,
    device: torch.device,
    *,
    slots: int,
    nixl_host: str,
    nixl_net_devices: tuple[str, ...],
    first_piece_bytes: int,
) -> tuple[list[Slot], SourceAgent]:
    """This rank's `slots` snapshot slots of `tensors`, registered with one new NIXL agent
    listening on `nixl_host` (`SourceConfig.host`, `SourceConfig.net_devices`), each with its
    report built once."""
    config = SourceConfig(
        # A name per process: a restarted trainer's agents are new peers to a receiver,
        # which would otherwise reuse its connection to the dead process's agent of the
        # same name (its first pulls hung until their deadline).
        name=f"trainer-rank{topology.rank}-{secrets.token_hex(4)}",
        rank=topology.rank,
        tensor_rank=topology.tp_rank,
        pipeline_stage=topology.pp_rank,
        host=nixl_host,
        net_devices=nixl_net_devices,
    )
    agent = SourceAgent.create(config)
    built = [
        create_slot(config, tensors, device, agent, first_piece_bytes=first_piece_bytes)
        for _ in range(slots)
    ]
    log.info(
        "refit: a snapshot copies %d memory regions holding %d tensors, in %d pieces",
        sum(len(parts) for parts, _ in built[0].pieces),
        len(tensors),
        len(built[0].pieces),
    )
    # Built after every slot is registered: the agent metadata in them covers all slots.
    reports = [
        publish_request(0, topology.rank, b.source.manifest(0, checksums=False)) for b in built
    ]
    for report, b in zip(reports, built, strict=True):
        with_words(report, b)
    filled = [
        Slot(
            b.source,
            b.pieces,
            report,
            b.words.tensor_view(0, torch.int64, (len(b.ends),)),
            b.registration,
        )
        for b, report in zip(built, reports, strict=True)
    ]
    return filled, agent
