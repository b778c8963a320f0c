"""A typed, synchronous client of the refit sidecar, speaking the manifest's domain types.

Status codes come back as the registry's domain errors: NOT_FOUND as `UnknownVersion` (calls
naming a version) or `UnknownLease` (calls naming a lease), RESOURCE_EXHAUSTED as
`SlotsExhausted`, FAILED_PRECONDITION as `PublicationPending`, ABORTED as `NotRegistered` (the
sidecar restarted, or another trainer registered since), ALREADY_EXISTS as `RegistrationHeld`
(another trainer's registration is alive), INVALID_ARGUMENT as `InvalidRequest` (a ValueError; its
`field` names the request field at fault when the sidecar named one).
The tree fan-out calls (`get_sources`, `release_sources`, `list_tree`) raise NOT_FOUND as
`UnknownVersion`, RESOURCE_EXHAUSTED as `NoSourceFree` (retry once a pull ends) and an
UNAVAILABLE the sidecar answered as `NoLiveSource` (one from the transport stays an RpcError).
Anything else (UNAVAILABLE, DEADLINE_EXCEEDED, ...) is raised as the `grpc.RpcError` it is.

Versions start at 1: the wire uses 0 for "none" (no readable version, no retired version),
which the client returns as None.

Every call carries the bearer token of `auth` (`trainer_refit.auth.ClientAuth`): the trainer
role's for the trainer-side calls, the receiver role's for the rest (docs/security.md). A
refused token is the `grpc.RpcError` UNAUTHENTICATED or PERMISSION_DENIED.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from refit_sidecar.core.manifest import Manifest
from refit_sidecar.core.plan import Checksums, Want
from refit_sidecar.core.tree_records import TreeListing
from refit_sidecar.service.pending import Pending
from refit_sidecar.service.registry import (
    NotRegistered,
    PendingVersion,
    PublicationPending,
    RegistrationHeld,
    RegistrationStatus,
    SlotsExhausted,
    UnknownLease,
    UnknownVersion,
)
from refit_sidecar.service.sources import (
    Answer,
    NoLiveSource,
    NoSourceFree,
    Offer,
    Sources,
    get_sources_request,
    listing_from_proto,
)
from refit_sidecar.service.wire import (
    checksums_from_proto,
    manifest_from_proto,
    manifest_key,
    publish_request,
)
from trainer_refit.auth import ClientAuth, call_metadata, open_channel
from trainer_refit.errors import InvalidRequest
from trainer_refit.status_details import violated_field
from trainer_refit.v1 import common_pb2
from trainer_refit.v1 import refit_pb2 as pb
from trainer_refit.v1 import refit_pb2_grpc as pb_grpc

__all__ = [
    "InvalidRequest",
    "Lease",
    "NoLiveSource",
    "NoSourceFree",
    "NotRegistered",
    "PublicationPending",
    "RegistrationHeld",
    "RegistrationStatus",
    "SidecarClient",
    "SlotsExhausted",
    "TrainerLayout",
    "UnknownLease",
    "UnknownVersion",
]

log = logging.getLogger(__name__)

Reply = TypeVar("Reply")
_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_SERVICE = pb.DESCRIPTOR.services_by_name["RefitService"].full_name


@dataclass(frozen=True, kw_only=True)
class TrainerLayout:
    """How the trainer's ranks are laid out; every one of the `world_size` ranks publishes."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1

    def __post_init__(self) -> None:
        if min(self.tensor_parallel, self.pipeline_parallel, self.data_parallel) < 1:
            raise ValueError(f"parallel sizes must be >= 1, got {self}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel

    def to_proto(self) -> common_pb2.ParallelLayout:
        return common_pb2.ParallelLayout(
            tensor_parallel=self.tensor_parallel,
            pipeline_parallel=self.pipeline_parallel,
            data_parallel=self.data_parallel,
            world_size=self.world_size,
        )


@dataclass(frozen=True)
class Lease:
    lease_id: str
    version: int
    expires_in_seconds: float
    """Seconds until the lease ended, as the sidecar saw it when it answered."""
    manifest_key: bytes = b""
    """Equal for versions whose manifests differ only in version and checksums (same slot);
    empty from renewals."""
    receiver_id: str = ""
    """The holder: only it may renew or release the lease."""
    checksums: tuple[Checksums, ...] | None = None
    """Asked for with the lease: every shard's checksums in the manifest's order (parameters,
    then their shards)."""
    expires_at: float = math.inf
    """A `time.monotonic()` by which the lease has surely ended: the call's start plus the
    sidecar's `expires_in_seconds` (the sidecar started the lease after the call did)."""
    readable_at: float = 0.0
    """When the version became readable, by the sidecar's clock (`time.time()`; 0 from
    renewals)."""
    answered_at: float = 0.0
    """When the sidecar built this answer, by its clock."""
    pending: bool = False
    """Leased before the version was readable (`before_readable`): its bytes are there once
    each source's version word names it; its checksums come from `checksums_later`."""


@dataclass(frozen=True)
class VersionChecksums:
    """A readable version's checksums (GetChecksums)."""

    version: int
    manifest_key: bytes
    checksums: tuple[Checksums, ...]
    """Every shard's, in the manifest's order (parameters, then their shards)."""


def lease_from_proto(reply: pb.Lease, sent: float | None = None) -> Lease:
    """`sent`: when the request went out (time.monotonic()); the lease ends for the holder
    `expires_in_seconds` after it, whatever the transit took."""
    return Lease(
        reply.lease_id,
        reply.version,
        reply.expires_in_seconds,
        reply.manifest_key,
        reply.receiver_id,
        tuple(checksums_from_proto(s) for s in reply.checksums) if reply.checksums else None,
        math.inf if sent is None else sent + reply.expires_in_seconds,
        reply.readable_at,
        reply.answered_at,
        reply.pending,
    )


class SidecarClient:
    """`SidecarClient("host:port", auth=ClientAuth(token_file=...))`; a context manager
    closing its channel. `timeout` is the deadline in seconds of each unary call (None: none);
    `watch` streams have no deadline."""

    def __init__(self, target: str, timeout: float | None = None, *, auth: ClientAuth) -> None:
        self.target = target
        self.timeout = timeout
        # A restarted sidecar is found again within a second, not after gRPC's default
        # exponential backoff (up to two minutes).
        # The token goes as each call's metadata, not through gRPC's interceptor layer.
        self._channel = open_channel(target, auth, options=_RECONNECT, bearer=False)
        self._metadata = call_metadata(auth)
        self._stub = pb_grpc.RefitServiceStub(self._channel)
        self.generation = 0
        """The registration this client made (`register_trainer`); 0: none."""

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(
        self,
        method: Callable[..., Reply],
        request: Any,
        not_found: type[LookupError] = UnknownVersion,
        *,
        tree: bool = False,
        extra_s: float = 0.0,
        deadline_s: float | None = None,
    ) -> Reply:
        """`extra_s`: seconds the call may take beyond the client's deadline (a wait);
        `deadline_s`: this call's own deadline before them, instead of the client's."""
        timeout = self._timeout(extra_s) if deadline_s is None else deadline_s + extra_s
        try:
            return method(request, timeout=timeout, metadata=self._metadata())
        except grpc.RpcError as error:
            mapped = _tree_error(error) if tree else None
            mapped = mapped or _domain_error(error, not_found)
            if mapped is None:
                raise
            raise mapped from error

    def _timeout(self, extra_s: float) -> float | None:
        return None if self.timeout is None else self.timeout + extra_s

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the sidecar's health service answers SERVING (TimeoutError after
        `timeout` seconds)."""
        health = health_pb2_grpc.HealthStub(self._channel)
        deadline = time.monotonic() + timeout
        serving = health_pb2.HealthCheckResponse.SERVING
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"refit sidecar at {self.target} not serving after {timeout} s")
            try:
                request = health_pb2.HealthCheckRequest(service=_SERVICE)
                reply = health.Check(
                    request, timeout=left, wait_for_ready=True, metadata=self._metadata()
                )
                if reply.status == serving:
                    return
            except grpc.RpcError as error:
                if error.code() not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                ):
                    raise
            time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))

    # -- trainer side -------------------------------------------------------------------------

    def register_trainer(
        self,
        layout: TrainerLayout,
        num_slots: int,
        *,
        owner: str,
        take_over: bool = False,
        generation: int = 0,
    ) -> int:
        """Start a new trainer generation held by `owner` (retires every earlier version and
        lease) and return it; this client's trainer-side calls present it from then on.
        `RegistrationHeld` while another owner's registration is alive, unless `take_over`
        or `generation` is the current one."""
        request = pb.RegisterTrainerRequest(
            layout=layout.to_proto(),
            num_slots=num_slots,
            owner=owner,
            take_over=take_over,
            generation=generation,
        )
        self.generation = self._call(self._stub.RegisterTrainer, request).generation
        return self.generation

    def renew_registration(
        self,
        generation: int | None = None,
        *,
        wait_version: int = 0,
        wait_s: float = 0.0,
        deadline_s: float | None = None,
    ) -> RegistrationStatus:
        """Keeps the registration alive; `NotRegistered` when it is not the sidecar's current
        one (the sidecar restarted, or another trainer registered since). With `wait_version`,
        answers once that version is no longer being published, or after `wait_s`.
        `deadline_s`: the call's deadline beyond that wait (None: the client's)."""
        request = pb.RenewRegistrationRequest(
            generation=self._generation(generation), wait_version=wait_version, wait_seconds=wait_s
        )
        reply = self._call(
            self._stub.RenewRegistration, request, extra_s=wait_s, deadline_s=deadline_s
        )
        return RegistrationStatus(
            reply.generation,
            tuple(PendingVersion(p.version, tuple(p.missing_ranks)) for p in reply.pending),
            reply.latest or None,
        )

    def _generation(self, generation: int | None) -> int:
        return self.generation if generation is None else generation

    def reserve_slot(
        self,
        version: int,
        *,
        ahead: bool = False,
        abandoned: Sequence[int] = (),
        generation: int | None = None,
    ) -> tuple[int, int | None]:
        """(slot for `version`, the version retired to free it, or None). `ahead`: before the
        step that makes `version`; keeps the latest version readable and never waits for a
        lease (SlotsExhausted instead). `abandoned`: versions being published that will never
        be complete. `generation`: the registration (None: the one this client made)."""
        if version < 1:
            raise ValueError(f"versions start at 1, got {version}")
        request = pb.ReserveSlotRequest(
            version=version,
            ahead=ahead,
            generation=self._generation(generation),
            abandoned=abandoned,
        )
        reply = self._call(self._stub.ReserveSlot, request)
        return reply.slot, reply.retired_version or None

    def publish(self, version: int, rank: int, partial: Manifest) -> bool:
        """Publish `rank`'s part of `version` (one agent, with its metadata blob, and its
        shards) in this client's registration; True when this made the version readable."""
        request = publish_request(version, rank, partial)
        request.generation = self.generation
        return self.send_publication(request)

    def send_publication(self, request: pb.PublishShardsRequest) -> bool:
        """`publish` for a request built ahead (`wire.publish_request`), which names its
        registration's generation."""
        return self._call(self._stub.PublishShards, request).visible

    # -- receiver side ------------------------------------------------------------------------

    def latest_version(self) -> int | None:
        reply = self._call(self._stub.GetLatestVersion, pb.GetLatestVersionRequest())
        return reply.version or None

    def wait_visible(self, version: int, timeout: float = 30.0) -> int:
        """Block until `version` or a newer one is readable; returns the latest. Trainer ranks
        report a finished step in the background, so its version becomes readable a moment
        after FinishTrainStep returns it (after the update, which FinishTrainStep does not wait
        for unless asked). TimeoutError after `timeout` seconds."""
        request = pb.WatchVersionsRequest(after_version=version - 1)
        call = self._stub.WatchVersions(request, timeout=timeout, metadata=self._metadata())
        try:
            for info in call:
                if info.version:  # 0: a trainer registered again, nothing readable yet
                    return info.version
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
        finally:
            call.cancel()
        raise TimeoutError(
            f"version {version} did not become readable at {self.target} within {timeout} s"
        )

    def manifest(self, version: int) -> Manifest:
        """The merged manifest of a readable version (UnknownVersion otherwise)."""
        reply = self._call(self._stub.GetManifest, pb.GetManifestRequest(version=version))
        return manifest_from_proto(reply)

    def pending_manifest(self, version: int) -> tuple[Manifest, bytes]:
        """The layout of `version`, reserved and not readable yet (`Manifest.pending`: where
        its shards and words will lie), and its manifest key; a readable version's manifest
        and key. A pending layout's shards carry a placeholder (0) of the checksums the
        trainer publishes for their memory (CRC-32 and WSUM-64 on the host, WSUM-64 on a GPU),
        so that a plan of it knows which reads its check covers; the values come with the
        version.
        UnknownVersion when the sidecar does not know the layout (or is older than the
        field)."""
        request = pb.GetManifestRequest(version=version, reserved=True)
        reply = self._call(self._stub.GetManifest, request)
        pending, reply.pending = reply.pending, False  # not part of the layout's key
        key = manifest_key(reply)
        if pending:
            for parameter in reply.parameters:
                for shard in parameter.shards:
                    shard.wsum64 = 0
                    if shard.location.memory != pb.MEMORY_KIND_VRAM:
                        shard.crc32 = 0
        return manifest_from_proto(reply), key

    def checksums(self, version: int) -> dict[str, tuple[Checksums, ...]]:
        """Per parameter, the checksums of each shard of a readable version: what a replayed
        plan needs from its manifest when it verifies."""
        reply = self._call(self._stub.GetManifest, pb.GetManifestRequest(version=version))
        return {p.name: tuple(checksums_from_proto(s) for s in p.shards) for p in reply.parameters}

    def acquire_lease(
        self,
        version: int,
        receiver_id: str,
        ttl: float,
        *,
        wait_s: float = 0.0,
        checksums: bool = False,
        before_readable: bool = False,
    ) -> Lease:
        """A lease on `version` for `ttl` seconds. `wait_s`: a version newer than every
        readable one is waited for that long on the sidecar, then leased (UnknownVersion if it
        is not readable by then); `checksums`: the lease carries the version's checksums.
        `before_readable`: leased as soon as its slot is reserved when the sidecar knows the
        slot's manifest key (then `Lease.pending`)."""
        request = _lease_request(
            version, receiver_id, ttl, wait_s, checksums, before_readable=before_readable
        )
        sent = time.monotonic()
        return lease_from_proto(self._call(self._stub.AcquireLease, request, extra_s=wait_s), sent)

    def lease_later(
        self,
        version: int,
        receiver_id: str,
        ttl: float,
        *,
        wait_s: float,
        checksums: bool = False,
        before_readable: bool = False,
    ) -> Pending[Lease]:
        """`acquire_lease` left in flight (`pending.Pending`): asked before `version` is
        readable, answered the moment it is (or after `wait_s`, UnknownVersion). Its lease's
        `expires_at` counts from the call's start, so a call parked long leaves little of it:
        renew before relying on it (`Receiver.fetch` does). `before_readable` as for
        `acquire_lease`."""
        request = _lease_request(
            version, receiver_id, ttl, wait_s, checksums, before_readable=before_readable
        )
        sent = time.monotonic()
        future = self._stub.AcquireLease.future(
            request, timeout=self._timeout(wait_s), metadata=self._metadata()
        )
        return Pending(
            future,
            lambda reply: lease_from_proto(reply, sent),
            lambda error: _domain_error(error, UnknownVersion),
        )

    def checksums_later(self, version: int, *, wait_s: float) -> Pending[VersionChecksums]:
        """GetChecksums left in flight: `version`'s checksums and manifest key once it is
        readable (UnknownVersion when it is not within `wait_s`)."""
        request = pb.GetChecksumsRequest(version=version, wait_seconds=wait_s)
        future = self._stub.GetChecksums.future(
            request, timeout=self._timeout(wait_s), metadata=self._metadata()
        )
        return Pending(
            future,
            lambda reply: VersionChecksums(
                reply.version,
                reply.manifest_key,
                tuple(checksums_from_proto(s) for s in reply.checksums),
            ),
            lambda error: _domain_error(error, UnknownVersion),
        )

    def renew_lease(self, lease: Lease, ttl: float) -> Lease:
        """Extend `lease` (as its holder, `lease.receiver_id`); UnknownLease when it ended or
        another receiver holds it."""
        request = pb.RenewLeaseRequest(
            lease_id=lease.lease_id, ttl_seconds=ttl, receiver_id=lease.receiver_id
        )
        return lease_from_proto(self._call(self._stub.RenewLease, request, UnknownLease))

    def release_lease(self, lease: Lease) -> None:
        """End `lease` (as its holder); UnknownLease when it ended or another receiver holds
        it."""
        request = pb.ReleaseLeaseRequest(lease_id=lease.lease_id, receiver_id=lease.receiver_id)
        self._call(self._stub.ReleaseLease, request, UnknownLease)

    def end_lease(self, lease: Lease) -> bool:
        """`release_lease`, logging a failure instead of raising it (a lease nobody ends runs
        out at its TTL); True when the sidecar still held the lease (it was valid all along)."""
        try:
            self.release_lease(lease)
        except Exception as e:
            log.warning(
                "releasing lease %s on version %d failed: %s", lease.lease_id, lease.version, e
            )
            return False
        return True

    # -- tree fan-out (docs/fanout.md) ---------------------------------------------------------

    def get_sources(
        self,
        version: int,
        receiver_id: str,
        wants: Sequence[Want],
        *,
        domain: str = "",
        offer: Offer | None = None,
        lost: Sequence[str] = (),
        wait_s: float = 0.0,
    ) -> Sources:
        """Where to read `wants` of `version` from. With `offer`, this receiver serves its
        copy to later receivers from now on (and its copy of an older version stops being
        handed out once its readers are done, bounded by the sidecar's drain timeout). `lost`:
        sources this receiver could not read from. Replaces this receiver's previous
        assignment of the version. `wait_s`: a version newer than every readable one is
        waited for that long on the sidecar (UnknownVersion if it is not readable by then)."""
        return self.ask_sources(
            version, receiver_id, wants, domain=domain, offer=offer, lost=lost, wait_s=wait_s
        ).sources()

    def ask_sources(
        self,
        version: int,
        receiver_id: str,
        wants: Sequence[Want],
        *,
        domain: str = "",
        offer: Offer | None = None,
        lost: Sequence[str] = (),
        wait_s: float = 0.0,
    ) -> Answer:
        """`get_sources`, the reply left unparsed until needed (`Answer.sources`)."""
        request = get_sources_request(
            version, receiver_id, wants, domain=domain, offer=offer, lost=lost, wait_s=wait_s
        )
        return self.ask(request)

    def ask(self, request: pb.GetSourcesRequest) -> Answer:
        """GetSources with a request built already (`sources.get_sources_request`): a
        receiver asking for every version with the same wants and offer builds it once. Its
        `wait_seconds` extends the call's deadline by as much."""
        extra = max(request.wait_seconds, 0.0)
        return Answer.of(self._call(self._stub.GetSources, request, tree=True, extra_s=extra))

    def ask_later(self, request: pb.GetSourcesRequest) -> Pending[Answer]:
        """`ask` left in flight (`pending.Pending`): with `wait_seconds`, the sidecar answers
        the moment the version is readable."""
        future = self._stub.GetSources.future(
            request,
            timeout=self._timeout(max(request.wait_seconds, 0.0)),
            metadata=self._metadata(),
        )
        return Pending(
            future,
            Answer.of,
            lambda error: _tree_error(error) or _domain_error(error, UnknownVersion),
        )

    def release_sources(self, version: int, receiver_id: str, *, complete: bool) -> None:
        """This receiver's pull of `version` ended: complete (its offered copy becomes
        complete) or failed (its offered copy is withdrawn)."""
        request = pb.ReleaseSourcesRequest(
            version=version, receiver_id=receiver_id, complete=complete
        )
        self._call(self._stub.ReleaseSources, request, tree=True)

    def list_tree(self, version: int) -> TreeListing:
        """Who reads `version` from whom now (no expiries: NodeInfo.expires_at is None)."""
        reply = self._call(self._stub.ListTree, pb.ListTreeRequest(version=version), tree=True)
        return listing_from_proto(reply)

    def watch(self, after_version: int = 0) -> Iterator[int]:
        """Readable versions newer than `after_version`: the latest at once when there is one,
        then each new one; 0 when a trainer registered again (nothing is readable until its
        first version, whose number starts again). The stream starts at the first `next()`;
        closing the iterator (or the client) ends it."""
        call = self._stub.WatchVersions(
            pb.WatchVersionsRequest(after_version=after_version), metadata=self._metadata()
        )
        try:
            for info in call:
                yield info.version
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.CANCELLED:
                return
            mapped = _domain_error(error, UnknownVersion)
            if mapped is None:
                raise
            raise mapped from error
        finally:
            call.cancel()


def _lease_request(
    version: int,
    receiver_id: str,
    ttl: float,
    wait_s: float,
    checksums: bool,
    *,
    before_readable: bool,
) -> pb.AcquireLeaseRequest:
    return pb.AcquireLeaseRequest(
        version=version,
        receiver_id=receiver_id,
        ttl_seconds=ttl,
        wait_seconds=wait_s,
        with_checksums=checksums,
        before_readable=before_readable,
    )


def _tree_error(error: grpc.RpcError) -> Exception | None:
    """The source tree's errors: RESOURCE_EXHAUSTED is `NoSourceFree`, and UNAVAILABLE is
    `NoLiveSource` when the sidecar answered it (its status then carries rich details, which
    a transport failure does not)."""
    code = error.code()
    details = error.details() or str(code)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return NoSourceFree(details)
    if code == grpc.StatusCode.UNAVAILABLE and _answered(error):
        return NoLiveSource(details)
    return None


def _answered(error: grpc.RpcError) -> bool:
    trailing = getattr(error, "trailing_metadata", None)
    metadata = trailing() if callable(trailing) else None
    return any(key == "grpc-status-details-bin" for key, _ in metadata or ())


def _domain_error(error: grpc.RpcError, not_found: type[LookupError]) -> Exception | None:
    """The domain error for `error`'s status code; None to raise the RpcError itself."""
    code = error.code()
    details = error.details() or str(code)
    if code == grpc.StatusCode.NOT_FOUND:
        return not_found(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return SlotsExhausted(details)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return PublicationPending(details)
    if code == grpc.StatusCode.ABORTED:
        return NotRegistered(details)
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return RegistrationHeld(details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(details, field=violated_field(error))
    return None
