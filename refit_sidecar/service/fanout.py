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
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence

from refit_sidecar.core.errors import UnknownVersion
from refit_sidecar.core.manifest import Manifest
from refit_sidecar.service.registry import Registry
from refit_sidecar.service.source_copies import (
    Checked,
    Copy,
    Offer,
    OpenManifest,
    checked_offer,
    checked_wants,
    listing_to_proto,
    peer_copy,
    trainer_shards,
)
from refit_sidecar.service.tree import (
    HeldForParent,
    PullOutcome,
    Receiver,
    Route,
    Tree,
    TreeConfig,
    TreeListing,
    UnknownSource,
)
from refit_sidecar.service.wire import (
    box_to_proto,
    manifest_from_proto,
    manifest_key,
)
from trainer_refit.errors import InvalidRequest
from trainer_refit.v1 import refit_pb2 as pb

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.005
"""How often a drain wait looks at the old copy's readers."""
_REPLIES_KEPT = 64
_NAMED_KEPT = 64


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
        self._open: dict[int, OpenManifest] = {}
        self._offers: dict[tuple[int, str], Offer] = {}
        self._layouts: dict[bytes, Manifest] = {}
        """By layout key: the domain manifest of the first version laid out so (its version
        and checksums are not used)."""
        self._last_checked: dict[str, Checked] = {}
        """Per receiver: its last request, checked."""
        self._named: OrderedDict[tuple[str, tuple[str, ...]], None] = OrderedDict()
        """The trainer ranks' copies (agent, tensors) replies named lately: built ahead for
        each new layout."""
        self._trainer_copies: OrderedDict[tuple[bytes, str, tuple[str, ...]], Copy]
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

    def _asked(self, request: pb.GetSourcesRequest) -> tuple[int, str, Checked]:
        """The request checked against its (open) version, and the peers it lost dropped."""
        rid = request.receiver_id
        if not rid:
            raise InvalidRequest("GetSources needs a receiver_id", field="receiver_id")
        opened = self._opened(request.version)
        checked = self._checked(request, opened.manifest)
        self._lost(request.version, rid, request.lost, opened.manifest)
        return request.version, rid, checked

    def _answer(self, request: pb.GetSourcesRequest, checked: Checked) -> pb.GetSourcesResponse:
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
            self._offers[(version, rid)] = Offer(checked)
        return self._reply(
            version, opened, rid, checked, assignment.routes, known=request.known_routing_keys
        )

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _reply(
        self,
        version: int,
        opened: OpenManifest,
        rid: str,
        checked: Checked,
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

    def _cached_reply(self, routes: tuple[Route, ...], copies: list[Copy]) -> pb.GetSourcesResponse:
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
            self._generation = self.registry.generation
            log.info("trainer generation %d: the source tree starts afresh", self._generation)
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

    def _opened(self, version: int) -> OpenManifest:
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
        opened = self._open[version] = OpenManifest(proto, manifest, layout_key)
        return opened

    # -- requests -------------------------------------------------------------------------------

    def _checked(self, request: pb.GetSourcesRequest, manifest: Manifest) -> Checked:
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
        wants = checked_wants(request, manifest)
        offer = checked_offer(request, wants, manifest) if request.HasField("offer") else None
        checked = Checked(wants_key, tuple(wants), offer, asked)
        self._last_checked[rid] = checked
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

    def _copy(self, version: int, opened: OpenManifest, source_id: str, names: list[str]) -> Copy:
        if source_id in opened.manifest.agents:
            return self._trainer_copy(opened, source_id, names)
        stored = self._offers.get((version, source_id))
        if stored is None:
            raise RuntimeError(f"version {version}: peer {source_id!r} has no offer on record")
        checked = stored.checked
        if checked.copy is None:
            checked.copy = peer_copy(opened, source_id, checked)
        return checked.copy

    def _trainer_copy(self, opened: OpenManifest, agent: str, names: list[str]) -> Copy:
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
        shards = trainer_shards(opened.proto, agent, names)
        copy = self._trainer_copies[laid_out] = Copy(
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
