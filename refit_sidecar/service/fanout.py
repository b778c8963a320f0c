"""The sidecar's tree fan-out RPCs (GetSources, ReleaseSources, ListTree) over a `Tree`.

`TreeService` owns the source tree and the copies receivers offer; the servicer hands it the
requests and returns its replies. It follows the registry: a version enters the tree on the
first GetSources or ListTree while it is readable (its roots the merged manifest's agents),
leaves it once the registry no longer has it readable, and a new trainer generation (version
numbers start again) starts from an empty tree.

What a reply names comes from the sidecar, never from a peer's claims: a trainer rank's copy is
the merged manifest restricted to its agent, a peer's is its offer (one shard per want). A reply
says where bytes lie, not what they must be: copies carry no checksums (a receiver checks what
it pulled against the trainer's checksums its lease brought), so a copy is the same for every
version laid out alike and is built once, and a steady tree's replies are cached whole. A
reply carries the copies of its routes' primaries; fallbacks are named only (a receiver whose
primary fails asks again, naming it lost).
A receiver offering a new version first waits, bounded by `drain_timeout_s`, until nobody
reads the copy of an older version it offered, then stops serving that copy (its memory is
about to be overwritten).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass

from refit_sidecar.core.errors import UnknownVersion
from refit_sidecar.core.manifest import Manifest, c_strides
from refit_sidecar.core.plan import Want
from refit_sidecar.service.registry import Registry
from refit_sidecar.service.tree import (
    CopyState,
    HeldForParent,
    NodeKind,
    PullOutcome,
    Receiver,
    Route,
    Tree,
    TreeConfig,
    TreeListing,
    UnknownSource,
)
from refit_sidecar.service.wire import (
    box_from_proto,
    box_to_proto,
    dtype_to_proto,
    location_from_proto,
    manifest_from_proto,
    manifest_key,
    progress_file_from_proto,
)
from trainer_refit.errors import InvalidRequest, quoted
from trainer_refit.v1 import refit_pb2 as pb

log = logging.getLogger(__name__)

PROGRESS_BYTES = 24
"""A peer's progress word: three little-endian uint64 (version, filled up to, state)."""
DRAIN_POLL_S = 0.005
"""How often a drain wait looks at the old copy's readers."""
_REPLIES_KEPT = 64
_NAMED_KEPT = 64

_KINDS = {
    NodeKind.TRAINER: pb.SOURCE_KIND_TRAINER,
    NodeKind.PEER: pb.SOURCE_KIND_PEER,
    NodeKind.RECEIVER: pb.SOURCE_KIND_UNSPECIFIED,
}


@dataclass(frozen=True)
class _Copy:
    """A source's copy as a reply names it, and the digest of where it lies
    (`wire.manifest_key`)."""

    message: pb.SourceCopy
    key: bytes


@dataclass(frozen=True)
class _Open:
    """A version open in the tree: its merged manifest, as proto and as domain record (shapes,
    boxes and agents; its version and checksums may be another version's), and its layout key
    (`wire.manifest_key`: the same for every version laid out alike)."""

    proto: pb.Manifest
    manifest: Manifest
    layout_key: bytes


@dataclass(eq=False)
class _Checked:
    """A receiver's last request, checked: reused while its bytes repeat."""

    wants_key: bytes
    """Digest of the wants alone."""
    wants: tuple[Want, ...]
    offer: pb.PeerOffer | None
    asked: pb.GetSourcesRequest
    """The request's wants and offer as received (what a later request is compared with)."""
    copy: _Copy | None = None
    """The offered copy as replies name it, built once per offer (`_peer_copy`)."""


@dataclass(frozen=True)
class _Offer:
    """An offer as stored: the checked request that made it."""

    checked: _Checked

    @property
    def offer(self) -> pb.PeerOffer:
        assert self.checked.offer is not None
        return self.checked.offer


class TreeService:
    """`manifest_of(version)`: the merged manifest of a readable version and its layout key
    (the servicer's `_manifest`: a digest without version and checksums), UnknownVersion
    otherwise."""

    def __init__(
        self,
        registry: Registry,
        manifest_of: Callable[[int], tuple[pb.Manifest, bytes]],
        config: TreeConfig,
        *,
        drain_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {drain_timeout_s}")
        self.registry = registry
        self.config = config
        self.drain_timeout_s = drain_timeout_s
        self._manifest_of = manifest_of
        self._clock = clock
        self._generation = registry.generation
        self._tree = Tree(config, clock)
        self._open: dict[int, _Open] = {}
        self._offers: dict[tuple[int, str], _Offer] = {}
        self._layouts: dict[bytes, Manifest] = {}
        """By layout key: the domain manifest of the first version laid out so (its version
        and checksums are not used)."""
        self._last_checked: dict[str, _Checked] = {}
        """Per receiver: its last request, checked."""
        self._named: OrderedDict[tuple[str, tuple[str, ...]], None] = OrderedDict()
        """The trainer ranks' copies (agent, tensors) replies named lately: built ahead for
        each new layout."""
        self._trainer_copies: OrderedDict[tuple[bytes, str, tuple[str, ...]], _Copy]
        self._trainer_copies = OrderedDict()
        """A trainer rank's shards of the wanted tensors, by (layout key, agent, names)."""
        self._replies: OrderedDict[
            tuple[object, ...], tuple[tuple[Route, ...], pb.GetSourcesResponse]
        ] = OrderedDict()
        """Replies (without version and expiry) by their routes (identity, kept alive here)
        and their primaries' copies: a steady tree repeats them."""
        self._changed = asyncio.Event()
        """Set (and replaced) whenever a receiver is assigned or releases: what a request
        waiting for a held parent waits on."""

    @property
    def tree(self) -> Tree:
        return self._tree

    # -- the RPCs -----------------------------------------------------------------------------

    async def get_sources(self, request: pb.GetSourcesRequest) -> pb.GetSourcesResponse:
        version, rid, checked = self._asked(request)
        if checked.offer is not None:
            await self._drain(version, rid)
        waited: HeldForParent | None = None
        while True:
            try:
                reply = self._answer(request, checked)
                break
            except HeldForParent as held:
                # The tree holds its previous shape for a moment: answer as soon as another
                # receiver asks or releases, or the hold ends, rather than have this one
                # retry.
                waited = held
                changed = self._changed
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), max(held.until - self._clock(), 0.0))
        if waited is not None and self._clock() >= waited.until:
            # Not the steady state (a parent that skipped this version, or a tree that changed
            # shape): say why a receiver waited the whole hold.
            log.info("version %d: %r waited out the tree's hold: %s", version, rid, waited)
        return reply

    def answer_together(
        self, requests: Sequence[pb.GetSourcesRequest]
    ) -> Iterator[tuple[int, pb.GetSourcesResponse | Exception]]:
        """GetSources for several receivers at once (the calls parked for a version that just
        became readable), without waiting: yields (index, its reply or its error) as each is
        answered. A receiver held for a parent among them is answered after it, so a chain is
        assigned in one pass, not one loop turn a level; one that has to wait (readers of its
        older copy to drain, or a held parent that is not among them) is not yielded, and
        `get_sources` then waits for it."""
        todo = list(range(len(requests)))
        while todo:
            held = []
            for i in todo:
                try:
                    version, rid, checked = self._asked(requests[i])
                    if checked.offer is not None and self._older_copy_read(version, rid):
                        continue
                    answer: pb.GetSourcesResponse | Exception = self._answer(requests[i], checked)
                except HeldForParent:
                    held.append(i)
                    continue
                except Exception as exc:  # the call's own error, as get_sources raises it
                    answer = exc
                yield i, answer
            if len(held) == len(todo):
                return  # their parents are elsewhere: they wait for them
            todo = held

    def _asked(self, request: pb.GetSourcesRequest) -> tuple[int, str, _Checked]:
        """The request checked against its (open) version, and the peers it lost dropped."""
        rid = request.receiver_id
        if not rid:
            raise InvalidRequest("GetSources needs a receiver_id", field="receiver_id")
        opened = self._opened(request.version)
        checked = self._checked(request, opened.manifest)
        self._lost(request.version, rid, request.lost, opened.manifest)
        return request.version, rid, checked

    def _answer(self, request: pb.GetSourcesRequest, checked: _Checked) -> pb.GetSourcesResponse:
        """Assigns the receiver's sources and builds its reply; HeldForParent while the tree
        holds a parent of its previous pull for it. Its older copies, unread, are withdrawn."""
        version, rid, offer = request.version, request.receiver_id, checked.offer
        opened = self._opened(version)  # the registry may have moved on while a call waited
        if offer is not None:
            self._withdraw_older(version, rid)
        assignment = self._tree.assign(
            version,
            Receiver(rid, request.domain),
            checked.wants,
            serve=offer is not None,
            wants_key=checked.wants_key,
        )
        self._notify()
        if offer is not None:
            self._offers[(version, rid)] = _Offer(checked)
        return self._reply(
            version, opened, rid, checked, assignment.routes, known=request.known_routing_keys
        )

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _reply(
        self,
        version: int,
        opened: _Open,
        rid: str,
        checked: _Checked,
        routes: tuple[Route, ...],
        *,
        known: Collection[bytes] = (),
    ) -> pb.GetSourcesResponse:
        """The reply; only its key when that is `known` (the caller holds its plan)."""
        names = list(dict.fromkeys(w.name for w in checked.wants))
        primaries = dict.fromkeys(r.primary for r in routes)
        copies = [self._copy(version, opened, s, names) for s in primaries]
        cached = self._cached_reply(routes, copies)
        if cached.routing_key in known:
            reply = pb.GetSourcesResponse(routing_key=cached.routing_key, routes_left_out=True)
        else:
            reply = pb.GetSourcesResponse()
            reply.CopyFrom(cached)
        reply.version = version
        expires_at = self._tree.peer_expiry(version, rid)
        if expires_at is not None:
            reply.offer_expires_in_seconds = max(expires_at - self._clock(), 0.0)
        if log.isEnabledFor(logging.DEBUG):
            self._debug(self._tree.tree(version))
        return reply

    def _cached_reply(
        self, routes: tuple[Route, ...], copies: list[_Copy]
    ) -> pb.GetSourcesResponse:
        """The reply holding `routes` and the primaries' `copies`, with its routing key: a
        digest of the routes without their fallbacks and of where each primary's copy lies.
        Built once per distinct pair."""
        # By the routes' identity: the tree hands a receiver the same routes object while
        # its assignment repeats (hashing a hundred routes would cost more than the rest).
        key = (id(routes), *(c.key for c in copies))
        cached = self._replies.get(key)
        if cached is not None and cached[0] is routes:
            self._replies.move_to_end(key)
            return cached[1]
        primaries = repr([(r.name, r.box.ranges, r.primary) for r in routes]).encode()
        message = pb.GetSourcesResponse(
            routes=[
                pb.SourceRoute(
                    name=r.name, box=box_to_proto(r.box), primary=r.primary, fallbacks=r.fallbacks
                )
                for r in routes
            ],
            sources=[c.message for c in copies],
            routing_key=hashlib.blake2b(
                b"".join([primaries, *(c.key for c in copies)]), digest_size=16
            ).digest(),
        )
        self._replies[key] = (routes, message)
        while len(self._replies) > _REPLIES_KEPT:
            self._replies.popitem(last=False)
        return message

    def release_sources(self, request: pb.ReleaseSourcesRequest) -> None:
        if not request.receiver_id:
            raise InvalidRequest("ReleaseSources needs a receiver_id", field="receiver_id")
        self._sync()
        outcome = PullOutcome.COMPLETE if request.complete else PullOutcome.FAILED
        orphans = self._tree.release(request.version, request.receiver_id, outcome)
        self._notify()
        if orphans:
            log.info(
                "version %d: %r failed; its readers fall back: %s",
                request.version,
                request.receiver_id,
                [o.child for o in orphans],
            )
        if outcome is PullOutcome.FAILED:
            self._offers.pop((request.version, request.receiver_id), None)
        if log.isEnabledFor(logging.DEBUG):
            self._debug(self._tree.tree(request.version))

    def list_tree(self, request: pb.ListTreeRequest) -> pb.TreeListing:
        self._opened(request.version)
        return listing_to_proto(self._tree.tree(request.version))

    # -- versions -------------------------------------------------------------------------------

    def _sync(self) -> None:
        """Follows the registry: a new trainer generation starts a fresh tree; versions no
        longer readable leave it."""
        if self.registry.generation != self._generation:
            log.info("trainer generation %d: the source tree starts afresh", self._generation)
            self._generation = self.registry.generation
            self._tree = Tree(self.config, self._clock)
            self._open.clear()
            self._offers.clear()
            self._last_checked.clear()
            self._layouts.clear()
            self._named.clear()
            self._trainer_copies.clear()
            self._replies.clear()
        readable = set(self.registry.readable())
        for version in self._tree.versions:
            if version not in readable:
                self._tree.retire(version)
                del self._open[version]
                log.debug("version %d left the source tree", version)
        for key in [k for k in self._offers if k[0] not in self._open]:
            del self._offers[key]

    def prepare(self, version: int) -> None:
        """Open a version that just became readable, with the trainer ranks' copies the last
        version's receivers asked for, so the first GetSources finds them built (they cost
        milliseconds per hundred tensors when the version is laid out anew). Never raises: a
        version gone by then is simply not opened."""
        try:
            opened = self._opened(version)
            # The trainer ranks' copies earlier replies named: receivers ask the same.
            for agent, names in list(self._named):
                self._trainer_copy(opened, agent, list(names))
        except UnknownVersion:
            pass
        except Exception:
            log.exception("opening version %d in the source tree failed", version)

    def _opened(self, version: int) -> _Open:
        """The open version, opened now when it is readable; UnknownVersion otherwise."""
        self._sync()
        opened = self._open.get(version)
        if opened is not None:
            return opened
        if version not in self.registry.readable():
            raise UnknownVersion(
                f"version {version} is not readable; readable: {self.registry.readable()}"
            )
        proto, layout_key = self._manifest_of(version)
        # Versions in the same trainer slot differ only in their version and checksums: the
        # domain record (shapes, boxes, agents) is parsed once.
        manifest = self._layouts.get(layout_key)
        if manifest is None:
            manifest = self._layouts[layout_key] = manifest_from_proto(proto)
        self._tree.open_version(version, manifest)
        opened = self._open[version] = _Open(proto, manifest, layout_key)
        return opened

    # -- requests -------------------------------------------------------------------------------

    def _checked(self, request: pb.GetSourcesRequest, manifest: Manifest) -> _Checked:
        """The request's wants and offer, checked. A receiver asks with the same wants and
        offer for every version (same layout, same staging): the checked values of its last
        request are reused when they are equal (they were checked against the same trainer
        generation's parameters)."""
        rid = request.receiver_id
        known = self._last_checked.get(rid)
        if (
            known is not None  # compared in C, field by field
            and known.asked.wants == request.wants
            and known.asked.HasField("offer") == request.HasField("offer")
            and known.asked.offer == request.offer
        ):
            return known
        asked = pb.GetSourcesRequest(wants=request.wants)
        if request.HasField("offer"):
            asked.offer.CopyFrom(request.offer)
        wants_key = hashlib.blake2b(
            pb.GetSourcesRequest(wants=request.wants).SerializeToString(deterministic=True),
            digest_size=16,
        ).digest()
        wants = self._wants(request, manifest)
        offer = self._offer(request, wants, manifest) if request.HasField("offer") else None
        checked = _Checked(wants_key, tuple(wants), offer, asked)
        self._last_checked[rid] = checked
        return checked

    @staticmethod
    def _wants(request: pb.GetSourcesRequest, manifest: Manifest) -> list[Want]:
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

    @staticmethod
    def _offer(
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
            loc = _own_location(location, rid, where)
            shape = want.box.shape
            if tuple(loc.shape) != shape:
                raise InvalidRequest(
                    f"{where}: shape {tuple(loc.shape)} is not the shape {shape} of want "
                    f"{want.name} {want.box.ranges}",
                    field=where,
                )
            parameter = manifest.get(want.name)
            assert parameter is not None  # checked by _wants
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
        progress = _own_location(offer.progress, rid, "offer.progress")
        if progress.nbytes < PROGRESS_BYTES:
            raise InvalidRequest(
                f"offer.progress: {progress.nbytes} bytes, the progress word needs "
                f"{PROGRESS_BYTES}",
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

    def _lost(self, version: int, rid: str, lost: Sequence[str], manifest: Manifest) -> None:
        """Peers the receiver could not read from stop being handed out for the version."""
        for source_id in dict.fromkeys(lost):
            if source_id in manifest.agents:
                log.warning(
                    "version %d: %r lost trainer rank %r; trainer ranks stay sources",
                    version,
                    rid,
                    source_id,
                )
                continue
            if source_id == rid:
                continue
            try:
                orphans = self._tree.unregister(version, source_id)
            except UnknownSource:
                continue
            self._offers.pop((version, source_id), None)
            log.info(
                "version %d: %r lost peer %r; its readers fall back: %s",
                version,
                rid,
                source_id,
                [o.child for o in orphans],
            )

    async def _drain(self, version: int, rid: str) -> None:
        """The receiver offers `version`: waits until nobody reads a copy of an older version
        it offered, or `drain_timeout_s` (one bound for all of them); `_withdraw_older` then
        stops handing those copies out."""
        deadline = self._clock() + self.drain_timeout_s
        for old in self._older_copies(version, rid):
            readers = self._tree.readers(old, rid)
            while readers and self._clock() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)
                self._sync()
                if old not in self._tree.versions:
                    readers = ()
                    break
                readers = self._tree.readers(old, rid)
            if readers:
                log.warning(
                    "version %d: %r withdraws its copy after %g s while %s still read it",
                    old,
                    rid,
                    self.drain_timeout_s,
                    list(readers),
                )

    def _older_copies(self, version: int, rid: str) -> list[int]:
        """The open versions before `version` whose copy `rid` serves."""
        return [old for old in self._tree.versions if old < version and self._serves(old, rid)]

    def _older_copy_read(self, version: int, rid: str) -> bool:
        """Somebody reads a copy `rid` offered of a version before `version`."""
        return any(self._tree.readers(old, rid) for old in self._older_copies(version, rid))

    def _withdraw_older(self, version: int, rid: str) -> None:
        """`rid`'s copies of versions before `version` stop being handed out: their memory is
        about to be overwritten."""
        for old in self._older_copies(version, rid):
            self._offers.pop((old, rid), None)
            self._tree.unregister(old, rid)

    def _serves(self, version: int, rid: str) -> bool:
        """`rid` is a peer (serving its copy) of the open `version`."""
        return self._tree.peer_expiry(version, rid) is not None

    # -- replies --------------------------------------------------------------------------------

    def _copy(self, version: int, opened: _Open, source_id: str, names: list[str]) -> _Copy:
        if source_id in opened.manifest.agents:
            return self._trainer_copy(opened, source_id, names)
        stored = self._offers.get((version, source_id))
        if stored is None:
            raise RuntimeError(f"version {version}: peer {source_id!r} has no offer on record")
        checked = stored.checked
        if checked.copy is None:
            checked.copy = _peer_copy(opened, source_id, checked)
        return checked.copy

    def _trainer_copy(self, opened: _Open, agent: str, names: list[str]) -> _Copy:
        key = (agent, tuple(names))
        self._named[key] = None
        self._named.move_to_end(key)
        while len(self._named) > _NAMED_KEPT:
            self._named.popitem(last=False)
        laid_out = (opened.layout_key, *key)
        copy = self._trainer_copies.get(laid_out)
        if copy is not None:
            self._trainer_copies.move_to_end(laid_out)
            return copy
        shards = _trainer_shards(opened.proto, agent, names)
        copy = self._trainer_copies[laid_out] = _Copy(
            pb.SourceCopy(source_id=agent, kind=pb.SOURCE_KIND_TRAINER, shards=shards),
            manifest_key(shards),
        )
        while len(self._trainer_copies) > _NAMED_KEPT:
            self._trainer_copies.popitem(last=False)
        return copy

    @staticmethod
    def _debug(listing: TreeListing) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s", listing.describe())


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


def _own_location(location: pb.ShardLocation, rid: str, where: str) -> pb.ShardLocation:
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


def _trainer_shards(merged: pb.Manifest, agent: str, names: list[str]) -> pb.Manifest:
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


def _peer_copy(opened: _Open, source_id: str, checked: _Checked) -> _Copy:
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
    return _Copy(message, key)
