"""The sidecar's gRPC service over the Registry: thin conversion, domain errors -> status codes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from refit_sidecar.core.tree_records import NoLiveSource, NoSourceFree, TreeConfig, UnknownSource
from refit_sidecar.service.access import METHOD_ROLES
from refit_sidecar.service.cli import SidecarConfig
from refit_sidecar.service.fanout import TreeService
from refit_sidecar.service.registry import (
    FullPolicy,
    NotRegistered,
    PublicationPending,
    RegistrationHeld,
    Registry,
    SlotsExhausted,
    TrainerShape,
    UnknownLease,
    UnknownVersion,
)
from refit_sidecar.service.wire import (
    checksums_from_proto,
    manifest_key,
    partial_from_request,
    set_checksums,
)
from trainer_refit.errors import InvalidRequest
from trainer_refit.serving import RunningServer, start_server, status_codes
from trainer_refit.v1 import common_pb2
from trainer_refit.v1 import refit_pb2 as pb
from trainer_refit.v1 import refit_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RefitService"].full_name

_CHECKED_REPORTS_KEPT = 256
"""Report layouts kept as checked: every rank's for every slot of a large trainer."""

_grpc_errors = status_codes(
    [
        (UnknownVersion, grpc.StatusCode.NOT_FOUND),
        (UnknownLease, grpc.StatusCode.NOT_FOUND),
        (UnknownSource, grpc.StatusCode.NOT_FOUND),
        (SlotsExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (NoSourceFree, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (NoLiveSource, grpc.StatusCode.UNAVAILABLE),
        (NotRegistered, grpc.StatusCode.ABORTED),
        (RegistrationHeld, grpc.StatusCode.ALREADY_EXISTS),
        (PublicationPending, grpc.StatusCode.FAILED_PRECONDITION),
        (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    ]
)


@dataclass(eq=False)
class _Parked:
    """A GetSources call waiting for its version, and what it was given once readable."""

    request: pb.GetSourcesRequest
    together: bool = False
    """Answered with the calls parked beside it (`_answer_parked`) once the version is
    readable: the call waits for `ready`."""
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    gone: bool = False
    """The call was cancelled (its receiver releases whatever it was assigned)."""
    lease: Any = None
    """Its lease, when taken for it with the calls beside it."""
    answer: pb.GetSourcesResponse | Exception | None = None
    """Its reply or error, when answered with the calls beside it; None: it goes on alone
    (its sources must wait)."""


class _Changes:
    """Wakes every waiter at once when the registry changes: a waiter woken needs no lock
    back (a Condition would hand its lock to each in turn, a loop iteration apiece)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float | None = None) -> None:
        """Until the next `notify`, or `timeout` seconds. The caller checks its condition
        just before, with no await between: no change can slip past."""
        event = self._event
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)


class RefitServicer(pb_grpc.RefitServiceServicer):
    def __init__(
        self,
        registry: Registry,
        tree: TreeConfig | None = None,
        *,
        drain_timeout_s: float = 5.0,
    ) -> None:
        self.registry = registry
        self._changes = _Changes()
        self._parked: dict[int, list[_Parked]] = {}
        """GetSources calls waiting for each version to be readable, in arrival order."""
        self._answering: set[asyncio.Task[None]] = set()
        """`_answer_parked` tasks running (kept referenced until done)."""
        self._layout = common_pb2.ParallelLayout()
        self._manifests: dict[int, tuple[pb.Manifest, bytes]] = {}
        self._checked_reports: OrderedDict[bytes, None] = OrderedDict()
        """Layouts of ranks' reports that parsed (`_check_report`)."""
        self._sums: dict[int, list[pb.ShardChecksums]] = {}
        self._readable_at: dict[int, float] = {}
        """When each version became readable (`time.time()`), for the leases' answers."""
        self._slot_keys: dict[int, bytes] = {}
        """Per slot, the manifest key of the last version readable there, or of the layout the
        trainer's ranks described (this generation): the key a version reserved in that slot
        will have, for leases before it is readable."""
        self._slot_manifests: dict[int, pb.Manifest] = {}
        """Per slot, the manifest `_slot_keys` is the key of, for GetManifest of a version
        reserved there (`Manifest.pending`)."""
        self._slot_layouts: dict[int, dict[int, pb.SlotLayout]] = {}
        """Per slot, the ranks' layouts described so far (`PublishShardsRequest.slot_layouts`),
        until every rank's is in."""
        self.tree = TreeService(
            registry,
            self._manifest,
            tree or TreeConfig(),
            drain_timeout_s=drain_timeout_s,
        )

    def _notify(self) -> None:
        self._changes.notify()

    def _version_info(self) -> pb.VersionInfo:
        latest = self.registry.latest
        if latest is None:
            return pb.VersionInfo(version=0)
        total = sum(
            shard.location.nbytes
            for request in self.registry.shards(latest).values()
            for parameter in request.parameters
            for shard in parameter.shards
        )
        return pb.VersionInfo(version=latest, total_bytes=total)

    @_grpc_errors
    async def RegisterTrainer(self, request: pb.RegisterTrainerRequest, context: Any) -> Any:
        layout = request.layout
        if not request.owner:
            raise InvalidRequest("a registration needs its owner's identity", field="owner")
        generation = self.registry.register_trainer(
            TrainerShape(world_size=layout.world_size, num_slots=request.num_slots),
            request.owner,
            take_over=request.take_over,
            generation=request.generation,
        )
        self._layout = layout
        # Versions are numbered afresh in a new generation: nothing cached by number survives,
        # nor anything known of the earlier trainer's slots.
        caches: tuple[dict[int, Any], ...] = (
            self._manifests,
            self._sums,
            self._readable_at,
            self._slot_keys,
            self._slot_manifests,
            self._slot_layouts,
        )
        for cache in caches:
            cache.clear()
        log.info(
            "trainer %r registered (generation %d): world size %d, %d slots",
            request.owner,
            generation,
            layout.world_size,
            request.num_slots,
        )
        self._notify()
        return pb.RegisterTrainerResponse(generation=generation)

    @_grpc_errors
    async def RenewRegistration(self, request: pb.RenewRegistrationRequest, context: Any) -> Any:
        self.registry.renew(request.generation)  # refused at once when not current
        wait = self._seconds(request.wait_seconds, "wait_seconds")
        if request.wait_version and wait > 0:
            version = request.wait_version
            await self._until(lambda: not self.registry.reserved(version), time.monotonic() + wait)
        status = self.registry.renew(request.generation)
        return pb.RegistrationStatus(
            generation=status.generation,
            pending=[
                pb.PendingVersion(version=p.version, missing_ranks=p.missing_ranks)
                for p in status.pending
            ],
            latest=status.latest or 0,
        )

    @_grpc_errors
    async def ReserveSlot(self, request: pb.ReserveSlotRequest, context: Any) -> Any:
        """Waits, bounded, for the previous version's last reports (always) and for a lease
        to end (under FullPolicy.WAIT, and not for a reservation ahead of its step)."""
        config = self.registry.config
        now = time.monotonic()
        lease_deadline = now + config.max_wait_seconds
        publish_deadline = now + config.publish_timeout_seconds
        while True:
            try:
                slot, retired = self.registry.reserve_slot(
                    request.version,
                    ahead=request.ahead,
                    generation=request.generation,
                    abandoned=tuple(request.abandoned),
                )
                self._notify()  # leases asked before the version is readable can be granted
                return pb.ReserveSlotResponse(slot=slot, retired_version=retired or 0)
            except PublicationPending as pending:
                if time.monotonic() >= publish_deadline:
                    raise PublicationPending(
                        f"{pending} after {config.publish_timeout_seconds:g} s; a trainer rank "
                        "may have failed: restart the trainer"
                    ) from None
                deadline = publish_deadline
            except SlotsExhausted:
                if (
                    request.ahead
                    or config.full_policy is FullPolicy.FAIL
                    or time.monotonic() >= lease_deadline
                ):
                    raise
                expiry = self.registry.next_expiry()
                deadline = min(lease_deadline, expiry if expiry is not None else lease_deadline)
            await self._changes.wait(max(deadline - time.monotonic(), 0.01))

    @_grpc_errors
    async def PublishShards(self, request: pb.PublishShardsRequest, context: Any) -> Any:
        self._check_report(request)
        visible = self.registry.publish(
            request.version, request.rank, request, generation=request.generation
        )
        if request.slot_layouts:
            self._describe_slots(request)
        if visible:
            log.info("version %d is readable", request.version)
            self._readable_at[request.version] = readable_at = time.time()
            readable = set(self.registry.readable())
            for old in [v for v in self._readable_at if v not in readable]:
                del self._readable_at[old]
            log.debug("version %d readable at %.6f", request.version, readable_at)
            together = [
                p for p in self._parked.get(request.version, ()) if p.request.lease_ttl_seconds
            ]
            for parked in together:
                parked.together = True
            self._notify()
            if together:
                self._answering.add(asyncio.create_task(self._answer_parked(together)))
            if request.version not in self._parked:
                # Right after this reply: the version's source tree, ready before receivers
                # ask. Receivers that asked ahead are answered first instead: they open the
                # tree as they need it, and would otherwise wait for all of it.
                asyncio.get_running_loop().call_soon(self.tree.prepare, request.version)
        return pb.PublishShardsResponse(visible=visible)

    @_grpc_errors
    async def GetLatestVersion(self, request: pb.GetLatestVersionRequest, context: Any) -> Any:
        return self._version_info()

    async def WatchVersions(
        self, request: pb.WatchVersionsRequest, context: Any
    ) -> AsyncIterator[pb.VersionInfo]:
        seen = request.after_version
        generation = self.registry.generation
        while True:
            if self.registry.generation != generation:
                # A trainer registered again and numbers its versions afresh: its versions
                # are new to the watcher whatever their numbers, and until one is readable
                # the watcher hears 0 (the earlier trainer's versions are gone).
                generation, seen = self.registry.generation, 0
                if self.registry.latest is None:
                    yield pb.VersionInfo(version=0)
            latest = self.registry.latest
            if latest is not None and latest > seen:
                seen = latest
                yield self._version_info()
            await self._changes.wait()

    @_grpc_errors
    async def GetManifest(self, request: pb.GetManifestRequest, context: Any) -> Any:
        if request.reserved and request.version not in self.registry.readable():
            return self._pending_manifest(request.version)
        return self._manifest(request.version)[0]

    def _pending_manifest(self, version: int) -> pb.Manifest:
        """The layout a reserved `version` will have: its slot's manifest, relabelled, without
        checksums (UnknownVersion when the version is not reserved or its slot's layout is
        not known)."""
        slot = self.registry.slot_of(version) if self.registry.reserved(version) else None
        known = None if slot is None else self._slot_manifests.get(slot)
        if known is None:
            raise UnknownVersion(
                f"version {version} is not reserved, or the layout of its slot is not known yet"
            )
        manifest = pb.Manifest()
        manifest.CopyFrom(known)
        manifest.version = version
        manifest.pending = True
        for parameter in manifest.parameters:
            for shard in parameter.shards:
                shard.ClearField("crc32")
                shard.ClearField("wsum64")
        return manifest

    def _describe_slots(self, request: pb.PublishShardsRequest) -> None:
        """Records a rank's layouts of its other slots (a report already taken, so of the
        current registration); a slot every rank has described gets its manifest and key, so
        that the first version reserved there is leased with a layout to plan."""
        shape = self.registry.trainer
        assert shape is not None  # the report was taken
        for layout in request.slot_layouts:
            if layout.slot in self._slot_keys:
                continue  # a version was readable there: its manifest says it all
            ranks = self._slot_layouts.setdefault(layout.slot, {})
            ranks[request.rank] = layout
            if len(ranks) == shape.world_size:
                del self._slot_layouts[layout.slot]
                reports = [(ranks[r].agent, ranks[r].parameters) for r in sorted(ranks)]
                described = self._merged(0, reports)
                self._slot_manifests[layout.slot] = described
                self._slot_keys[layout.slot] = manifest_key(described)

    def _check_report(self, request: pb.PublishShardsRequest) -> None:
        """A rank's report parses and names only its own memory (`wire.partial_from_request`),
        or it is refused and nothing is recorded. Checked once per layout (the report with its
        version and checksums cleared): a slot's reports differ in those alone, so a version's
        report costs its digest, not a parse of every parameter, on the way to readability."""
        key = manifest_key(request)
        if key in self._checked_reports:
            self._checked_reports.move_to_end(key)
            return
        try:
            partial_from_request(request)
        except ValueError as e:
            raise InvalidRequest(
                f"the report of rank {request.rank} for version {request.version}: {e}",
                field="parameters",
            ) from e
        self._check_layouts(request)
        self._checked_reports[key] = None
        while len(self._checked_reports) > _CHECKED_REPORTS_KEPT:
            self._checked_reports.popitem(last=False)

    def _check_layouts(self, request: pb.PublishShardsRequest) -> None:
        """A report's layouts of the rank's other slots parse as reports of its own agent,
        one per slot the trainer registered, or the report is refused."""
        shape = self.registry.trainer
        seen: set[int] = set()
        for layout in request.slot_layouts:
            problem = None
            if shape is not None and layout.slot >= shape.num_slots:
                problem = f"the trainer registered {shape.num_slots} slots"
            elif layout.slot in seen:
                problem = "given twice"
            elif layout.agent.name != request.agent.name:
                problem = f"agent {layout.agent.name!r} is not the report's"
            else:
                try:
                    partial_from_request(
                        pb.PublishShardsRequest(
                            rank=request.rank, agent=layout.agent, parameters=layout.parameters
                        )
                    )
                except ValueError as e:
                    problem = str(e)
            if problem is not None:
                raise InvalidRequest(
                    f"the report of rank {request.rank} for version {request.version}: its "
                    f"layout of slot {layout.slot}: {problem}",
                    field="slot_layouts",
                )
            seen.add(layout.slot)

    def _manifest(self, version: int) -> tuple[pb.Manifest, bytes]:
        """The merged manifest of a readable version and its `manifest_key`, built once and
        kept while the version is readable."""
        by_rank = self.registry.shards(version)
        cached = self._manifests.get(version)
        if cached is not None:
            return cached
        reports = [(by_rank[r].agent, by_rank[r].parameters) for r in sorted(by_rank)]
        manifest = self._merged(version, reports)
        readable = set(self.registry.readable())
        for stale in [v for v in self._manifests if v not in readable]:
            del self._manifests[stale]
        self._manifests[version] = built = (manifest, manifest_key(manifest))
        slot = self.registry.slot_of(version)
        if slot is not None:
            self._slot_keys[slot] = built[1]
            self._slot_manifests[slot] = manifest
        return built

    def _merged(
        self, version: int, reports: list[tuple[pb.SourceAgent, Sequence[pb.ParameterRecord]]]
    ) -> pb.Manifest:
        """One manifest of the ranks' reports (agent, parameters), in rank order: each
        tensor's shards together, tensors by name."""
        manifest = pb.Manifest(version=version, layout=self._layout)
        parts: dict[str, list[pb.ParameterRecord]] = {}
        for agent, parameters in reports:
            manifest.agents.append(agent)
            for parameter in parameters:
                parts.setdefault(parameter.name, []).append(parameter)
        for name in sorted(parts):
            first, *others = parts[name]
            merged = manifest.parameters.add()
            merged.CopyFrom(first)  # a tensor one rank holds is copied whole, in C
            for other in others:
                merged.shards.extend(other.shards)
        return manifest

    def _lease(self, lease: Any, key: bytes = b"") -> pb.Lease:
        return pb.Lease(
            lease_id=lease.lease_id,
            version=lease.version,
            expires_in_seconds=lease.expires_at - time.monotonic(),
            manifest_key=key,
            receiver_id=lease.receiver_id,
        )

    @_grpc_errors
    async def AcquireLease(self, request: pb.AcquireLeaseRequest, context: Any) -> Any:
        version = request.version
        if request.before_readable:
            deadline = time.monotonic() + self._seconds(request.wait_seconds, "wait_seconds")
            await self._until(lambda: not self._waiting(version, reserved=True), deadline)
            key = self._reserved_key(version)
            if key is not None:
                lease = self.registry.acquire_lease(
                    version, request.receiver_id, request.ttl_seconds, before_readable=True
                )
                reply = self._lease(lease, key)
                reply.pending = True
                reply.answered_at = time.time()
                return reply
            await self._until(lambda: not self._waiting(version), deadline)
        else:
            await self._wait_requested(version, request.wait_seconds)
        lease = self.registry.acquire_lease(version, request.receiver_id, request.ttl_seconds)
        return self._granted(lease, request.with_checksums)

    def _reserved_key(self, version: int) -> bytes | None:
        """The manifest key `version` will have, when it is being published into a slot that
        held a readable version of this trainer before; None otherwise."""
        if not self.registry.reserved(version):
            return None
        slot = self.registry.slot_of(version)
        return None if slot is None else self._slot_keys.get(slot)

    @_grpc_errors
    async def GetChecksums(self, request: pb.GetChecksumsRequest, context: Any) -> Any:
        await self._wait_requested(request.version, request.wait_seconds)
        self.registry.visible(request.version)  # UnknownVersion: not readable in time
        manifest_key = self._manifest(request.version)[1]
        return pb.VersionChecksums(
            version=request.version,
            manifest_key=manifest_key,
            checksums=self._checksums(request.version),
        )

    def _granted(self, lease: Any, with_checksums: bool) -> pb.Lease:
        """A lease just granted on a readable version, with its manifest key, and its
        checksums when asked for."""
        reply = self._lease(lease, self._manifest(lease.version)[1])
        if with_checksums:
            reply.checksums.extend(self._checksums(lease.version))
        reply.readable_at = self._readable_at.get(lease.version, 0.0)
        reply.answered_at = time.time()
        return reply

    def _seconds(self, value: float, field: str) -> float:
        """A request's `field`, checked to lie in [0, --max-lease-seconds]."""
        bound = self.registry.config.max_lease_seconds
        if not 0 <= value <= bound:  # NaN fails too
            raise InvalidRequest(f"{field} must lie in [0, {bound}], got {value}", field=field)
        return value

    async def _wait_requested(self, version: int, wait: float) -> None:
        """A request's `wait_seconds`, checked, then waited for `version` to be readable."""
        if self._seconds(wait, "wait_seconds") > 0:
            await self._until_readable(version, wait)

    async def _until_readable(self, version: int, timeout: float) -> None:
        """Returns once `version` is readable, or can no longer become so (a newer one is), or
        after `timeout` seconds; the caller then leases it or fails."""
        await self._until(lambda: not self._waiting(version), time.monotonic() + timeout)

    def _waiting(self, version: int, *, reserved: bool = False) -> bool:
        """Whether `version` may still become readable (with `reserved`: reserved) and is not
        yet."""
        if reserved and self.registry.reserved(version):
            return False
        latest = self.registry.latest
        return version not in self.registry.readable() and (latest is None or latest < version)

    async def _until(self, done: Callable[[], bool], deadline: float) -> None:
        """Returns once `done()`, or at `deadline` (time.monotonic())."""
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            await self._changes.wait(remaining)

    def _checksums(self, version: int) -> list[pb.ShardChecksums]:
        """Every shard's checksums in the merged manifest's order, built once per version."""
        cached = self._sums.get(version)
        if cached is None:
            manifest = self._manifest(version)[0]
            cached = []
            for parameter in manifest.parameters:
                for shard in parameter.shards:
                    sums = pb.ShardChecksums()
                    set_checksums(sums, checksums_from_proto(shard))
                    cached.append(sums)
            for stale in [v for v in self._sums if v not in self._manifests]:
                del self._sums[stale]
            self._sums[version] = cached
        return cached

    @_grpc_errors
    async def RenewLease(self, request: pb.RenewLeaseRequest, context: Any) -> Any:
        lease = self.registry.renew_lease(
            request.lease_id, request.ttl_seconds, receiver_id=request.receiver_id
        )
        return self._lease(lease)

    @_grpc_errors
    async def ReleaseLease(self, request: pb.ReleaseLeaseRequest, context: Any) -> Any:
        self.registry.release_lease(request.lease_id, receiver_id=request.receiver_id)
        self._notify()
        return pb.ReleaseLeaseResponse()

    # -- tree fan-out (docs/fanout.md) --------------------------------------------------------

    @_grpc_errors
    async def GetSources(self, request: pb.GetSourcesRequest, context: Any) -> Any:
        ttl = self._seconds(request.lease_ttl_seconds, "lease_ttl_seconds")
        woke = 0.0
        parked = None
        if request.wait_seconds:
            parked = _Parked(request)
            self._parked.setdefault(request.version, []).append(parked)
            try:
                await self._wait_requested(request.version, request.wait_seconds)
                woke = time.time()
                if parked.together:
                    await parked.ready.wait()
            except asyncio.CancelledError:
                parked.gone = True
                if parked.lease is not None:  # taken for it beside others, never delivered
                    self._end(parked.lease)
                    parked.lease = None
                raise
            finally:
                waiting = self._parked[request.version]
                waiting.remove(parked)
                if not waiting:
                    del self._parked[request.version]
            if not ttl:
                # The leases woken by the same publication answer first: a receiver that
                # asked for its lease apart replays its plan with it while its sources are
                # being assigned. (One asking for both in this call waits for nobody.)
                await asyncio.sleep(0)
        if parked is not None and parked.answer is not None:
            reply = parked.answer
        elif not ttl:
            return await self.tree.get_sources(request)
        else:
            reply = await self._sources_with_lease(request, ttl, parked)
        self._debug_answer(request, woke)
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def _answer_parked(self, together: list[_Parked]) -> None:
        """Answers the calls parked for a version that just became readable and asking for
        their leases too: their leases, then their sources (`TreeService.answer_together`:
        a chain in one pass, parents first), each call let go with its reply before the
        next is assigned. A call whose sources must wait keeps its lease and goes on alone."""
        try:
            leased = []
            for parked in together:
                request = parked.request
                if parked.gone:
                    continue
                try:
                    parked.lease = self.registry.acquire_lease(
                        request.version, request.receiver_id, request.lease_ttl_seconds
                    )
                    leased.append(parked)
                except Exception as exc:  # the call's own error
                    parked.answer = exc
                    parked.ready.set()
            order = []
            for i, answer in self.tree.answer_together([p.request for p in leased]):
                parked = leased[i]
                order.append(parked.request.receiver_id)
                if parked.lease is None:
                    continue  # cancelled meanwhile: its lease ended
                if isinstance(answer, pb.GetSourcesResponse):
                    with_sums = parked.request.lease_with_checksums
                    answer.lease.CopyFrom(self._granted(parked.lease, with_sums))
                else:
                    self._end(parked.lease)
                    parked.lease = None
                parked.answer = answer
                parked.ready.set()
                await asyncio.sleep(0)  # its call returns before the next is assigned
            log.debug(
                "version %d: parked calls answered together, in order: %s; going on alone: %s",
                together[0].request.version,
                order,
                [p.request.receiver_id for p in leased if p.answer is None],
            )
        except Exception:
            log.exception("answering the calls parked for a version failed; each goes on alone")
        finally:
            for parked in together:
                parked.ready.set()
            self._answering.discard(asyncio.current_task())

    async def _sources_with_lease(
        self, request: pb.GetSourcesRequest, ttl: float, parked: _Parked | None
    ) -> pb.GetSourcesResponse:
        """The lease first (the version must be readable, its slot held; a parked call may
        hold it already), then the sources; a lease whose sources cannot be given ends
        again, so a refused call holds nothing."""
        lease = parked.lease if parked is not None else None
        if lease is None:
            lease = self.registry.acquire_lease(request.version, request.receiver_id, ttl)
        try:
            reply = await self.tree.get_sources(request)
        except BaseException:
            self._end(lease)
            raise
        reply.lease.CopyFrom(self._granted(lease, request.lease_with_checksums))
        return reply

    def _end(self, lease: Any) -> None:
        self.registry.release_lease(lease.lease_id, receiver_id=lease.receiver_id)
        self._notify()

    @staticmethod
    def _debug_answer(request: pb.GetSourcesRequest, woke: float) -> None:
        if log.isEnabledFor(logging.DEBUG):
            now = time.time()
            log.debug(
                "version %d: sources for %r at %.6f (%.3f ms after its call woke)",
                request.version,
                request.receiver_id,
                now,
                1e3 * (now - woke) if woke else 0.0,
            )

    @_grpc_errors
    async def ReleaseSources(self, request: pb.ReleaseSourcesRequest, context: Any) -> Any:
        self.tree.release_sources(request)
        return pb.ReleaseSourcesResponse()

    @_grpc_errors
    async def ListTree(self, request: pb.ListTreeRequest, context: Any) -> Any:
        return self.tree.list_tree(request)


async def create_server(config: SidecarConfig) -> RunningServer:
    servicer = RefitServicer(
        Registry(config.registry), config.tree, drain_timeout_s=config.drain_timeout_s
    )
    return await start_server(
        lambda server: pb_grpc.add_RefitServiceServicer_to_server(servicer, server),
        SERVICE_NAME,
        host=config.host,
        port=config.port,
        credentials=config.auth.credentials(),
        interceptors=config.auth.interceptors(METHOD_ROLES),
    )
