"""What a receiver is told to read a version from (GetSources), as torch-free values.

`Offer` is what a receiver serves to later receivers: its NIXL agent, where each of its wants
lies in its registered memory (C order, one location per want, in the wants' order) and its
progress word. `Sources` is the sidecar's answer: `routes` (per want, pieces tiling it, each
with a primary source and ordered fallbacks) and one `SourceCopy` per source a route names,
holding that source's shards of the wanted tensors as a `Manifest` with the source's one agent.

The proto conversions of these values (and of a `TreeListing`) live here too, so the client
stays a thin caller. `NoSourceFree` (RESOURCE_EXHAUSTED: retry once a pull ends) and
`NoLiveSource` (UNAVAILABLE) are the tree's errors, re-exported for callers of the client.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from refit_sidecar.core.manifest import AgentRecord, Manifest, ShardLocation
from refit_sidecar.core.plan import Want
from refit_sidecar.core.shared_word_ref import ProgressFileRef
from refit_sidecar.core.tree_records import (
    CopyState,
    Edge,
    NodeInfo,
    NodeKind,
    NoLiveSource,
    NoSourceFree,
    Route,
    TreeListing,
)
from refit_sidecar.service.wire import (
    agent_to_proto,
    box_from_proto,
    box_to_proto,
    location_from_proto,
    location_to_proto,
    manifest_from_proto,
    progress_file_from_proto,
    progress_file_to_proto,
)
from trainer_refit.v1 import refit_pb2 as pb

__all__ = [
    "Answer",
    "NoLiveSource",
    "NoSourceFree",
    "Offer",
    "SourceCopy",
    "Sources",
    "get_sources_request",
    "listing_from_proto",
    "sources_from_proto",
]

_KINDS = {pb.SOURCE_KIND_TRAINER: NodeKind.TRAINER, pb.SOURCE_KIND_PEER: NodeKind.PEER}


@dataclass(frozen=True)
class Offer:
    """A receiver's copy offered to later receivers (GetSources' `offer`)."""

    agent: AgentRecord
    """The receiver's NIXL agent, named as its receiver id, with its metadata blob."""
    locations: tuple[ShardLocation, ...]
    """Where each want lies, C order: one per want, in the wants' order."""
    progress: ShardLocation
    """24 bytes of registered memory: version, filled-up-to address, state (docs in the
    proto)."""
    progress_file: ProgressFileRef | None = None
    """The same word mirrored in a file on this receiver's host (`shared_word.py`)."""


@dataclass(frozen=True)
class SourceCopy:
    """A source named by a route: its shards of the wanted tensors."""

    source_id: str
    kind: NodeKind
    """TRAINER (a trainer rank's NIXL agent) or PEER (a receiver serving its copy)."""
    shards: Manifest
    """The version's shards this source holds, restricted to the wanted tensors, with its one
    agent. A peer's shard carries a CRC-32 only where the sidecar derived it from the
    trainer's manifest."""
    progress: ShardLocation | None
    """A peer's progress word; None for a trainer rank."""
    progress_file: ProgressFileRef | None = None
    """A peer's mirror of its word, when it offered one."""


@dataclass(frozen=True)
class Sources:
    """GetSources' answer."""

    version: int
    routes: tuple[Route, ...]
    """Per want, in order, pieces that tile it exactly once."""
    copies: Mapping[str, SourceCopy]
    """By source id: every route's primary (fallbacks are named, their copies not sent: a
    receiver whose primary fails asks again). Where bytes lie, without checksums."""
    offer_expires_in_s: float
    """Seconds until an offered copy's registration ends (0 without an offer)."""
    key: bytes = b""
    """The sidecar's `routing_key` (else a digest of the whole answer without its version
    number, checksums and expiry): two answers with the same key read the same boxes from the
    same memory into the same memory, so a receiver replays the plan it made for the first."""


def get_sources_request(
    version: int,
    receiver_id: str,
    wants: Sequence[Want],
    *,
    domain: str = "",
    offer: Offer | None = None,
    lost: Sequence[str] = (),
    wait_s: float = 0.0,
) -> pb.GetSourcesRequest:
    request = pb.GetSourcesRequest(
        version=version,
        receiver_id=receiver_id,
        domain=domain,
        wants=[pb.WantedBox(name=w.name, box=box_to_proto(w.box)) for w in wants],
        lost=list(lost),
        wait_seconds=wait_s,
    )
    if offer is not None:
        request.offer.CopyFrom(
            pb.PeerOffer(
                agent=agent_to_proto(offer.agent),
                locations=[location_to_proto(loc) for loc in offer.locations],
                progress=location_to_proto(offer.progress),
                progress_file=progress_file_to_proto(offer.progress_file),
            )
        )
    return request


@dataclass(frozen=True)
class Answer:
    """GetSources' reply as received: its key at once, its values parsed when asked for (a
    receiver that met the key before replays its plan and parses nothing)."""

    version: int
    key: bytes
    """`Sources.key`."""
    reply: pb.GetSourcesResponse

    @classmethod
    def of(cls, reply: pb.GetSourcesResponse) -> Answer:
        return cls(reply.version, reply.routing_key or answer_key(reply), reply)

    @property
    def primaries(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.primary for r in self.reply.routes))

    def sources(self, *, copies_of: Collection[str] | None = None) -> Sources:
        """The values; `copies_of`: parse only these sources' copies (the primaries, say)."""
        return sources_from_proto(self.reply, copies_of=copies_of, key=self.key)


def sources_from_proto(
    reply: pb.GetSourcesResponse,
    *,
    copies_of: Collection[str] | None = None,
    key: bytes | None = None,
) -> Sources:
    routes = tuple(
        Route(r.name, box_from_proto(r.box), r.primary, tuple(r.fallbacks)) for r in reply.routes
    )
    copies: dict[str, SourceCopy] = {}
    for copy in reply.sources:
        if copies_of is not None and copy.source_id not in copies_of:
            continue
        kind = _KINDS.get(copy.kind)
        if kind is None:
            raise ValueError(f"source {copy.source_id!r} has no kind (trainer or peer)")
        progress = location_from_proto(copy.progress) if copy.HasField("progress") else None
        copies[copy.source_id] = SourceCopy(
            copy.source_id,
            kind,
            manifest_from_proto(copy.shards),
            progress,
            progress_file_from_proto(copy),
        )
    return Sources(
        reply.version,
        routes,
        copies,
        reply.offer_expires_in_seconds,
        (reply.routing_key or answer_key(reply)) if key is None else key,
    )


def answer_key(reply: pb.GetSourcesResponse) -> bytes:
    """`Sources.key` of an answer that does not carry the sidecar's `routing_key`."""
    bare = pb.GetSourcesResponse()
    bare.CopyFrom(reply)
    bare.version = 0
    bare.offer_expires_in_seconds = 0
    for copy in bare.sources:
        copy.shards.version = 0
        for parameter in copy.shards.parameters:
            for shard in parameter.shards:
                shard.ClearField("crc32")
                shard.ClearField("wsum64")
    return hashlib.blake2b(bare.SerializeToString(deterministic=True), digest_size=16).digest()


def listing_from_proto(reply: pb.TreeListing) -> TreeListing:
    """The tree as `Tree.tree` lists it, without expiries (the wire has none): a node of no
    source kind is a RECEIVER that only reads."""
    nodes = tuple(
        NodeInfo(
            n.node_id,
            _KINDS.get(n.kind, NodeKind.RECEIVER),
            n.domain,
            CopyState.COMPLETE if n.complete else CopyState.FILLING,
            n.depth,
            n.children,
            None,
        )
        for n in reply.nodes
    )
    edges = tuple(Edge(e.parent, e.child, e.active) for e in reply.edges)
    return TreeListing(reply.version, nodes, edges)
