"""The sidecar's book of versions, snapshot slots and leases (torch-free, clock injected).

Each trainer rank keeps ``num_slots`` snapshot buffers. At FinishTrainStep the trainer asks for a
slot for the new version (``reserve_slot``); the registry hands out a free slot or the slot of the
oldest version nobody leases, retiring that version first, so a leased version's bytes are never
overwritten. Each rank then copies its shards into the slot and reports them (``publish``); the
version becomes visible once every rank has. Ranks report in the background, so the next
reservation may arrive before the last report: it is served only once no version is being
published (``PublicationPending``), which also keeps the latest readable version from being
retired before its successor is readable. Leases expire after their TTL, so a dead receiver
cannot pin a slot for ever. Lease ids are unguessable, and only a lease's holder (the receiver
id that acquired it) may renew or release it: to anyone else it does not exist.

One trainer owns the registry at a time. A registration carries its owner's identity and a
generation, a fencing token every reservation and report of the trainer presents: a second
trainer cannot register while the owner renews its registration (`RegistrationHeld`) unless it
takes over, and once one has, the replaced trainer's calls are refused (`Superseded`), so its
ranks can never complete a version of the new registration's world with their shards. The
token is only as strong as the trainer role's credential: a caller holding it may take over on
purpose (docs/security.md).
"""

from __future__ import annotations

import enum
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from refit_sidecar.core.errors import (
    NotRegistered,
    PublicationPending,
    RegistrationHeld,
    SlotsExhausted,
    Superseded,
    UnknownLease,
    UnknownVersion,
)
from trainer_refit.errors import InvalidRequest

log = logging.getLogger(__name__)


class FullPolicy(enum.Enum):
    """What FinishTrainStep does when every slot holds a leased version."""

    WAIT = "wait"
    """Wait (bounded) for a lease to end."""
    FAIL = "fail"
    """Fail the step at once with a clear error."""


class VersionState(enum.Enum):
    PUBLISHING = "publishing"
    VISIBLE = "visible"


@dataclass(frozen=True, kw_only=True)
class RegistryConfig:
    full_policy: FullPolicy = FullPolicy.WAIT
    max_wait_seconds: float = 60.0
    """How long a slot reservation waits for a lease to end under FullPolicy.WAIT."""
    max_lease_seconds: float = 600.0
    publish_timeout_seconds: float = 60.0
    """How long a slot reservation waits for the previous version's ranks to report."""
    trainer_ttl_seconds: float = 10.0
    """A registration not renewed (RenewRegistration, or any call of its trainer) for this
    long is no longer alive: another trainer may register without taking over."""

    def __post_init__(self) -> None:
        if self.max_wait_seconds < 0 or self.max_lease_seconds <= 0:
            raise ValueError("max_wait_seconds must be >= 0 and max_lease_seconds > 0")
        if self.publish_timeout_seconds <= 0:
            raise ValueError("publish_timeout_seconds must be > 0")
        if self.trainer_ttl_seconds <= 0:
            raise ValueError("trainer_ttl_seconds must be > 0")


@dataclass(frozen=True, kw_only=True)
class TrainerShape:
    """What the registered trainer brings: its ranks and each rank's snapshot slots."""

    world_size: int
    """Ranks that must publish a version before it becomes visible."""
    num_slots: int

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise InvalidRequest(f"num_slots must be >= 1, got {self.num_slots}", field="num_slots")
        if self.world_size < 1:
            raise InvalidRequest(
                f"world_size must be >= 1, got {self.world_size}", field="layout.world_size"
            )


@dataclass(frozen=True)
class PendingVersion:
    version: int
    missing_ranks: tuple[int, ...]


@dataclass(frozen=True)
class RegistrationStatus:
    """What a renewal tells the owner: its generation, the versions it is still publishing
    and the newest readable one (None: none)."""

    generation: int
    pending: tuple[PendingVersion, ...]
    latest: int | None


@dataclass
class VersionRecord:
    version: int
    slot: int
    state: VersionState = VersionState.PUBLISHING
    shards_by_rank: dict[int, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Lease:
    lease_id: str
    version: int
    receiver_id: str
    expires_at: float
    ttl: float = 0.0
    """As granted or last renewed: a lease on a version still being published does not
    expire, and its TTL starts again when the version becomes readable."""


class Registry:
    def __init__(self, config: RegistryConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._versions: dict[int, VersionRecord] = {}
        self._slot_owner: dict[int, int] = {}
        self._leases: dict[str, Lease] = {}
        self._newest = 0
        """The highest version ever reserved in this generation: numbers only grow."""
        self.trainer: TrainerShape | None = None
        self.owner = ""
        self._owner_seen = 0.0
        """When the registration's owner last called (renewals, reservations, reports)."""
        self.generation = secrets.randbits(48)
        """The current registration's fencing token: one more per registration, from a random
        start in each life of the sidecar, so a token from an earlier life is never current.
        A new trainer numbers its versions afresh."""

    def register_trainer(
        self,
        trainer: TrainerShape,
        owner: str = "",
        *,
        take_over: bool = False,
        generation: int = 0,
    ) -> int:
        """Starts a new generation held by `owner`, and returns it: earlier versions and their
        leases are gone. Refused (`RegistrationHeld`) while another owner's registration is
        alive, unless `take_over` or `generation` is the current one."""
        if self.trainer is not None and owner != self.owner:
            alive_for = self._owner_seen + self.config.trainer_ttl_seconds - self._clock()
            if alive_for > 0 and not take_over and generation != self.generation:
                raise RegistrationHeld(
                    f"this sidecar is registered to trainer {self.owner!r} (generation "
                    f"{self.generation}, world size {self.trainer.world_size}), which renewed "
                    f"its registration {self.config.trainer_ttl_seconds - alive_for:.1f} s ago; "
                    "a sidecar serves one trainer: point this one at its own sidecar, or take "
                    "over once the other is gone"
                )
            log.warning(
                "trainer %r replaces the registration of trainer %r (generation %d)%s",
                owner,
                self.owner,
                self.generation,
                " by taking over" if alive_for > 0 else ", which stopped renewing it",
            )
        self.trainer = trainer
        self.owner = owner
        self._owner_seen = self._clock()
        self.generation += 1
        self._versions.clear()
        self._slot_owner.clear()
        self._leases.clear()
        self._newest = 0
        return self.generation

    def _shape(self, generation: int | None = None) -> TrainerShape:
        """The registered trainer; with `generation` (a trainer's call), only when that is the
        current registration, which the call keeps alive."""
        if self.trainer is None:
            raise NotRegistered(
                "no trainer has registered with this sidecar (it started or restarted since)"
            )
        if generation is not None:
            if generation != self.generation:
                raise Superseded(
                    f"generation {generation} is not this sidecar's registration: trainer "
                    f"{self.owner!r} registered generation {self.generation} since; the "
                    "caller no longer publishes here"
                )
            self._owner_seen = self._clock()
        return self.trainer

    def renew(self, generation: int) -> RegistrationStatus:
        """The owner's heartbeat: keeps its registration alive, and says what it is still
        publishing."""
        shape = self._shape(generation)
        pending = tuple(
            PendingVersion(
                v,
                tuple(sorted(set(range(shape.world_size)) - set(self._versions[v].shards_by_rank))),
            )
            for v in self._publishing()
        )
        return RegistrationStatus(self.generation, pending, self.latest)

    # -- trainer side -----------------------------------------------------------------------

    def reserve_slot(
        self,
        version: int,
        *,
        ahead: bool = False,
        generation: int | None = None,
        abandoned: tuple[int, ...] = (),
    ) -> tuple[int, int | None]:
        """Chooses the slot that will hold ``version`` and retires the version it held (returned
        second). Raises SlotsExhausted when all are leased (the caller applies the wait policy)
        and PublicationPending while an earlier version is being published (the caller waits).
        Reserving again a version no rank has published yet (its step failed before
        publication) returns the same slot. `ahead`: reserved before the step that makes
        `version`, so the latest readable version is not a candidate. `generation`: the
        trainer's registration (None: a caller in this process). `abandoned`: versions still
        being published that the trainer gave up on, retired first (`abandon`).
        """
        shape = self._shape(generation)
        self.abandon(abandoned)
        record = self._versions.get(version)
        if record is not None:
            if record.state is VersionState.PUBLISHING and not record.shards_by_rank:
                return record.slot, None
            raise InvalidRequest(f"version {version} was already reserved", field="version")
        if version <= self._newest:
            raise InvalidRequest(
                f"version {version} is not newer than the latest ({self._newest})",
                field="version",
            )
        pending = self._publishing()
        if pending:
            raise PublicationPending("; ".join(self._describe_pending(v) for v in pending))
        slot = self._free_slot(keep=self.latest if ahead else None)
        if slot is None:
            leased = sorted(self._leased_versions())
            if ahead:
                raise SlotsExhausted(
                    f"no slot to reserve ahead for version {version}: the latest readable "
                    f"version is {self.latest}, leased are {leased}"
                )
            raise SlotsExhausted(
                f"all {shape.num_slots} snapshot slots hold leased versions {leased}; "
                "release a lease or start the trainer with more slots"
            )
        previous = self._slot_owner.get(slot)
        if previous is not None:
            del self._versions[previous]  # retired: unknown from now on, its shards dropped
        self._slot_owner[slot] = version
        self._versions[version] = VersionRecord(version=version, slot=slot)
        self._newest = version
        return slot, previous

    def abandon(self, versions: tuple[int, ...]) -> None:
        """Retires each of `versions` still being published: it will never be readable, its
        slot is free, and leases taken on it before it was readable end."""
        for version in versions:
            record = self._versions.get(version)
            if record is None or record.state is not VersionState.PUBLISHING:
                continue
            log.warning(
                "version %d abandoned by its trainer: ranks %s had reported it",
                version,
                sorted(record.shards_by_rank),
            )
            del self._versions[version]
            del self._slot_owner[record.slot]
            for lease_id, lease in list(self._leases.items()):
                if lease.version == version:
                    del self._leases[lease_id]

    def _publishing(self) -> list[int]:
        return sorted(v for v, r in self._versions.items() if r.state is VersionState.PUBLISHING)

    def _describe_pending(self, version: int) -> str:
        reported = self._versions[version].shards_by_rank
        missing = sorted(set(range(self._shape().world_size)) - set(reported))
        return f"version {version} is still being published: ranks {missing} have not reported it"

    def _free_slot(self, keep: int | None = None) -> int | None:
        """A never-used slot, else the slot of the oldest unleased version but `keep`."""
        for slot in range(self._shape().num_slots):
            if slot not in self._slot_owner:
                return slot
        leased = self._leased_versions()
        candidates = [
            (version, slot)
            for slot, version in self._slot_owner.items()
            if version not in leased and version != keep
        ]
        return min(candidates)[1] if candidates else None

    def publish(
        self, version: int, rank: int, shards: Any, *, generation: int | None = None
    ) -> bool:
        """Records one rank's shards of ``version``; True when this made the version visible
        (every rank of the registered world has reported). `generation` as `reserve_slot`."""
        world_size = self._shape(generation).world_size
        record = self._versions.get(version)
        if record is None or record.state is not VersionState.PUBLISHING:
            if record is not None and rank in record.shards_by_rank:
                return False  # a report sent again after its answer was lost: it counted
            raise UnknownVersion(f"version {version} has no reserved slot being published")
        if not 0 <= rank < world_size:
            raise InvalidRequest(f"rank {rank} is outside the world of {world_size}", field="rank")
        record.shards_by_rank[rank] = shards
        if len(record.shards_by_rank) < world_size:
            return False
        record.state = VersionState.VISIBLE
        now = self._clock()
        for lease_id, lease in list(self._leases.items()):
            if lease.version == version:  # leased before it was readable: its TTL starts now
                self._leases[lease_id] = replace(lease, expires_at=now + lease.ttl)
        return True

    def readable(self) -> list[int]:
        return sorted(v for v, r in self._versions.items() if r.state is VersionState.VISIBLE)

    @property
    def latest(self) -> int | None:
        """The newest readable version: None before the first, and while a single slot's
        version is retired for its successor that is still being published."""
        return max(self.readable(), default=None)

    # -- receiver side ----------------------------------------------------------------------

    def visible(self, version: int) -> VersionRecord:
        record = self._versions.get(version)
        if record is None or record.state is not VersionState.VISIBLE:
            raise UnknownVersion(
                f"version {version} is not readable; readable now: {self.readable()}"
            )
        return record

    def shards(self, version: int) -> Mapping[int, Any]:
        return dict(self.visible(version).shards_by_rank)

    def reserved(self, version: int) -> bool:
        """Whether `version` has a slot and is being published (not readable yet)."""
        record = self._versions.get(version)
        return record is not None and record.state is VersionState.PUBLISHING

    def slot_of(self, version: int) -> int | None:
        """The slot holding (or reserved for) `version`; None for a version unknown."""
        record = self._versions.get(version)
        return None if record is None else record.slot

    def acquire_lease(
        self, version: int, receiver_id: str, ttl_seconds: float, *, before_readable: bool = False
    ) -> Lease:
        """A lease on a readable version; with `before_readable`, on a version still being
        published too (its slot is reserved, and no other version gets it while the lease
        lasts)."""
        if not receiver_id:
            raise InvalidRequest("a lease needs a receiver id (its holder)", field="receiver_id")
        if not (before_readable and self.reserved(version)):
            self.visible(version)
        ttl = self._ttl(ttl_seconds)
        lease = Lease(
            lease_id=secrets.token_urlsafe(16),
            version=version,
            receiver_id=receiver_id,
            expires_at=self._clock() + ttl,
            ttl=ttl,
        )
        self._leases[lease.lease_id] = lease
        return lease

    def renew_lease(self, lease_id: str, ttl_seconds: float, *, receiver_id: str) -> Lease:
        lease = self._held_lease(lease_id, receiver_id)
        ttl = self._ttl(ttl_seconds)
        renewed = Lease(lease.lease_id, lease.version, lease.receiver_id, self._clock() + ttl, ttl)
        self._leases[lease_id] = renewed
        return renewed

    def release_lease(self, lease_id: str, *, receiver_id: str) -> None:
        self._held_lease(lease_id, receiver_id)
        del self._leases[lease_id]

    def _ttl(self, ttl_seconds: float) -> float:
        if not 0 < ttl_seconds <= self.config.max_lease_seconds:
            raise InvalidRequest(
                f"lease ttl must lie in (0, {self.config.max_lease_seconds}] seconds, "
                f"got {ttl_seconds}",
                field="ttl_seconds",
            )
        return ttl_seconds

    def _held_lease(self, lease_id: str, receiver_id: str) -> Lease:
        """The live lease `lease_id` of `receiver_id`. Held by another receiver, it is
        UnknownLease with the same message as a lease that does not exist, so a caller learns
        nothing about other receivers' leases."""
        self._expire()
        lease = self._leases.get(lease_id)
        if lease is not None and lease.receiver_id != receiver_id:
            log.warning(
                "receiver %r named a lease of receiver %r on version %d: refused",
                receiver_id,
                lease.receiver_id,
                lease.version,
            )
            lease = None
        if lease is None:
            raise UnknownLease(
                f"receiver {receiver_id!r} holds no lease {lease_id!r} (never acquired, "
                "released, or expired)"
            )
        return lease

    def _expire(self) -> None:
        """Drops the leases past their end, but those on a version still being published (its
        slot is reserved for it anyway; their TTL starts when it becomes readable)."""
        now = self._clock()
        for lease_id, lease in list(self._leases.items()):
            if lease.expires_at <= now and not self.reserved(lease.version):
                del self._leases[lease_id]

    def _leased_versions(self) -> set[int]:
        self._expire()
        return {lease.version for lease in self._leases.values()}

    def next_expiry(self) -> float | None:
        """When the earliest lease ends (for a bounded wait), or None without leases."""
        self._expire()
        return min(
            (
                lease.expires_at
                for lease in self._leases.values()
                if not self.reserved(lease.version)
            ),
            default=None,
        )
