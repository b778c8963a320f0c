"""The copies a GetSources reply names, and the checks of what a receiver asks with
(`fanout.TreeService`): its wants against the version's parameters, its offer against its
wants (one C-ordered location per want in its own memory, a progress word). A trainer rank's
copy is the merged manifest restricted to its agent, a peer's is its offer; neither carries
checksums, so a copy is the same for every version laid out alike and is built once.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

from refit_sidecar.core.manifest import Manifest, c_strides
from refit_sidecar.core.plan import Want
from refit_sidecar.core.tree_records import CopyState, NodeKind, TreeListing
from refit_sidecar.service.wire import (
    box_from_proto,
    box_to_proto,
    dtype_to_proto,
    location_from_proto,
    progress_file_from_proto,
)
from trainer_refit.errors import InvalidRequest, quoted
from trainer_refit.v1 import refit_pb2 as pb

PROGRESS_BYTES = 24
"""A peer's progress word: three little-endian uint64 (version, filled up to, state)."""

_KINDS = {
    NodeKind.TRAINER: pb.SOURCE_KIND_TRAINER,
    NodeKind.PEER: pb.SOURCE_KIND_PEER,
    NodeKind.RECEIVER: pb.SOURCE_KIND_UNSPECIFIED,
}


@dataclass(frozen=True)
class Copy:
    """A source's copy as a reply names it, and the digest of where it lies
    (`wire.manifest_key`)."""

    message: pb.SourceCopy
    key: bytes


@dataclass(frozen=True)
class OpenManifest:
    """A version open in the tree: its merged manifest, as proto and as domain record (shapes,
    boxes and agents; its version and checksums may be another version's), and its layout key
    (`wire.manifest_key`: the same for every version laid out alike)."""

    proto: pb.Manifest
    manifest: Manifest
    layout_key: bytes


@dataclass(eq=False)
class Checked:
    """A receiver's last request, checked: reused while its bytes repeat."""

    wants_key: bytes
    """Digest of the wants alone."""
    wants: tuple[Want, ...]
    offer: pb.PeerOffer | None
    asked: pb.GetSourcesRequest
    """The request's wants and offer as received (what a later request is compared with)."""
    copy: Copy | None = None
    """The offered copy as replies name it, built once per offer (`peer_copy`)."""


@dataclass(frozen=True)
class Offer:
    """An offer as stored: the checked request that made it."""

    checked: Checked

    @property
    def offer(self) -> pb.PeerOffer:
        assert self.checked.offer is not None
        return self.checked.offer


def checked_wants(request: pb.GetSourcesRequest, manifest: Manifest) -> list[Want]:
    """The request's wants, each a box within a parameter of the version."""
    wants = []
    for i, wanted in enumerate(request.wants):
        try:
            box = box_from_proto(wanted.box)
        except ValueError as exc:
            raise InvalidRequest(f"want {i} ({wanted.name}): {exc}", field="wants") from None
        parameter = manifest.get(wanted.name)
        if parameter is None:
            raise InvalidRequest(
                f"{quoted(wanted.name)} is not a parameter of version {request.version}",
                field="wants",
            )
        if not box.within(parameter.shape):
            raise InvalidRequest(
                f"{wanted.name}: box {box.ranges} is outside shape {parameter.shape}",
                field="wants",
            )
        wants.append(Want(wanted.name, box))
    return wants


def checked_offer(
    request: pb.GetSourcesRequest, wants: Sequence[Want], manifest: Manifest
) -> pb.PeerOffer:
    """The offer checked against the wants, its locations' agents and C strides filled in
    where left empty."""
    rid, offer = request.receiver_id, request.offer
    if offer.agent.name != rid:
        raise InvalidRequest(
            f"the offer's agent {quoted(offer.agent.name)} is not the receiver {quoted(rid)}",
            field="offer.agent.name",
        )
    if not offer.agent.metadata:
        raise InvalidRequest(
            "the offer's agent has no NIXL metadata blob", field="offer.agent.metadata"
        )
    if len(offer.locations) != len(wants):
        raise InvalidRequest(
            f"the offer has {len(offer.locations)} locations for {len(wants)} wants; one "
            "per want, in order",
            field="offer.locations",
        )
    checked = pb.PeerOffer(agent=offer.agent)
    for i, (want, location) in enumerate(zip(wants, offer.locations, strict=True)):
        where = f"offer.locations[{i}]"
        loc = own_location(location, rid, where)
        shape = want.box.shape
        if tuple(loc.shape) != shape:
            raise InvalidRequest(
                f"{where}: shape {tuple(loc.shape)} is not the shape {shape} of want "
                f"{want.name} {want.box.ranges}",
                field=where,
            )
        parameter = manifest.get(want.name)
        assert parameter is not None  # checked by checked_wants
        nbytes = math.prod(shape) * parameter.dtype.itemsize
        if loc.nbytes != nbytes:
            raise InvalidRequest(
                f"{where}: {loc.nbytes} bytes for a {shape} box of {parameter.dtype.value} "
                f"({nbytes} bytes)",
                field=where,
            )
        if tuple(loc.strides) != c_strides(shape):
            raise InvalidRequest(
                f"{where}: strides {tuple(loc.strides)} are not C order for {shape}",
                field=where,
            )
        checked.locations.append(loc)
    if not offer.HasField("progress"):
        raise InvalidRequest("the offer has no progress location", field="offer.progress")
    progress = own_location(offer.progress, rid, "offer.progress")
    if progress.nbytes < PROGRESS_BYTES:
        raise InvalidRequest(
            f"offer.progress: {progress.nbytes} bytes, the progress word needs {PROGRESS_BYTES}",
            field="offer.progress",
        )
    checked.progress.CopyFrom(progress)
    mirror = progress_file_from_proto(offer)
    if mirror is not None:
        problem = mirror.check()
        if problem is not None:
            raise InvalidRequest(f"offer.progress_file: {problem}", field="offer.progress_file")
        checked.progress_file.CopyFrom(offer.progress_file)
    return checked


def listing_to_proto(listing: TreeListing) -> pb.TreeListing:
    return pb.TreeListing(
        version=listing.version,
        nodes=[
            pb.TreeNode(
                node_id=n.node_id,
                kind=_KINDS[n.kind],
                domain=n.domain,
                complete=n.state is CopyState.COMPLETE,
                depth=n.depth,
                children=n.children,
                serves=n.kind is not NodeKind.RECEIVER,
            )
            for n in listing.nodes
        ],
        edges=[pb.TreeEdge(parent=e.parent, child=e.child, active=e.active) for e in listing.edges],
        depth=listing.depth,
    )


def own_location(location: pb.ShardLocation, rid: str, where: str) -> pb.ShardLocation:
    """`location` in the receiver's own memory, its agent and C strides filled in when
    empty; checked as the manifest checks a shard location."""
    if location.agent and location.agent != rid:
        raise InvalidRequest(
            f"{where}: agent {quoted(location.agent)} is not the receiver {quoted(rid)}",
            field=where,
        )
    filled = pb.ShardLocation()
    filled.CopyFrom(location)
    filled.agent = rid
    if not filled.strides:
        filled.strides.extend(c_strides(filled.shape))
    try:
        location_from_proto(filled)
    except ValueError as exc:
        raise InvalidRequest(f"{where}: {exc}", field=where) from None
    return filled


def trainer_shards(merged: pb.Manifest, agent: str, names: list[str]) -> pb.Manifest:
    """The merged manifest restricted to one trainer rank's agent and the wanted tensors, as
    version 0 without checksums."""
    out = pb.Manifest(layout=merged.layout)
    out.agents.extend(a for a in merged.agents if a.name == agent)
    wanted = set(names)
    for parameter in merged.parameters:
        if parameter.name not in wanted:
            continue
        shards = []
        for shard in parameter.shards:
            if shard.location.agent == agent:
                shards.append(bare := pb.ShardRecord())
                bare.CopyFrom(shard)  # the merged manifest keeps its checksums
                bare.ClearField("crc32")
                bare.ClearField("wsum64")
        if shards:
            out.parameters.append(
                pb.ParameterRecord(
                    name=parameter.name,
                    shape=parameter.shape,
                    dtype=parameter.dtype,
                    shards=shards,
                )
            )
    return out


def peer_copy(opened: OpenManifest, source_id: str, checked: Checked) -> Copy:
    """A peer's copy as a manifest of version 0: one shard per want of the peer, the want's
    box at local zero in the offered location. All of them, not only the tensors the caller
    wants: the caller finds where the copy starts (what its progress word counts from) in
    them. Its key covers the progress word's location too."""
    assert checked.offer is not None
    out = pb.Manifest(layout=opened.proto.layout)
    out.agents.append(checked.offer.agent)
    records: dict[str, pb.ParameterRecord] = {}
    for want, location in zip(checked.wants, checked.offer.locations, strict=True):
        record = records.get(want.name)
        if record is None:
            merged = opened.manifest.get(want.name)
            assert merged is not None  # the wants were checked against it
            record = records[want.name] = pb.ParameterRecord(
                name=want.name, shape=merged.shape, dtype=dtype_to_proto(merged.dtype)
            )
        record.shards.append(
            pb.ShardRecord(
                location=location,
                pieces=[pb.ShardPiece(box=box_to_proto(want.box), local_start=[0] * want.box.ndim)],
            )
        )
    out.parameters.extend(records.values())
    key = hashlib.blake2b(
        out.SerializeToString(deterministic=True)
        + checked.offer.progress.SerializeToString(deterministic=True)
        + checked.offer.progress_file.SerializeToString(deterministic=True),
        digest_size=16,
    ).digest()
    message = pb.SourceCopy(
        source_id=source_id, kind=pb.SOURCE_KIND_PEER, shards=out, progress=checked.offer.progress
    )
    if checked.offer.HasField("progress_file"):
        message.progress_file.CopyFrom(checked.offer.progress_file)
    return Copy(message, key)
