"""Versions, snapshot slots and leases of the sidecar, against an injected clock."""

from __future__ import annotations

import pytest

from refit_sidecar.service.registry import (
    NotRegistered,
    PendingVersion,
    PublicationPending,
    RegistrationHeld,
    Registry,
    RegistryConfig,
    SlotsExhausted,
    Superseded,
    TrainerShape,
    UnknownLease,
    UnknownVersion,
    VersionState,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(world_size: int = 1, num_slots: int = 2, clock=None, **config) -> Registry:
    registry = Registry(RegistryConfig(**config), *([clock] if clock else []))
    registry.register_trainer(TrainerShape(world_size=world_size, num_slots=num_slots))
    return registry


def publish_all(registry: Registry, version: int) -> int:
    slot, _ = registry.reserve_slot(version)
    assert registry.trainer is not None
    for rank in range(registry.trainer.world_size):
        registry.publish(version, rank, {"rank": rank, "version": version})
    return slot


def test_a_version_becomes_visible_only_when_every_rank_published():
    registry = make(world_size=2)
    registry.reserve_slot(1)
    assert registry.publish(1, 0, "shards of rank 0") is False
    with pytest.raises(UnknownVersion):
        registry.visible(1)
    assert registry.latest is None
    assert registry.publish(1, 1, "shards of rank 1") is True
    assert registry.latest == 1
    assert registry.shards(1) == {0: "shards of rank 0", 1: "shards of rank 1"}


def test_slots_rotate_and_retire_the_oldest_unleased_version():
    registry = make(num_slots=2)
    assert publish_all(registry, 1) == 0
    assert publish_all(registry, 2) == 1
    assert publish_all(registry, 3) == 0
    with pytest.raises(UnknownVersion, match="readable now: \\[2, 3\\]"):
        registry.visible(1)


def test_a_leased_version_is_never_overwritten():
    clock = Clock()
    registry = make(num_slots=2, clock=clock)
    publish_all(registry, 1)
    lease = registry.acquire_lease(1, "receiver-a", ttl_seconds=30)
    publish_all(registry, 2)
    assert publish_all(registry, 3) == 1  # slot of version 2, not the leased version 1
    publish_all(registry, 4)  # takes version 3's slot again
    assert registry.visible(1).state is VersionState.VISIBLE
    assert registry.shards(1)[0] == {"rank": 0, "version": 1}
    registry.release_lease(lease.lease_id, receiver_id="receiver-a")
    publish_all(registry, 5)
    with pytest.raises(UnknownVersion):
        registry.visible(1)


def test_a_version_leased_before_it_is_readable_keeps_its_lease_until_its_ttl_after():
    """`before_readable`: a reserved version can be leased; the lease does not run out while
    the version is being published (however long its step takes), its TTL starts again when
    the version becomes readable, and while it lasts the slot goes to no other version."""
    clock = Clock()
    registry = make(num_slots=2, clock=clock)
    publish_all(registry, 1)
    with pytest.raises(UnknownVersion):
        registry.acquire_lease(2, "receiver-a", ttl_seconds=10)  # not reserved yet
    slot, _ = registry.reserve_slot(2)
    with pytest.raises(UnknownVersion):
        registry.acquire_lease(2, "receiver-a", ttl_seconds=10)  # not readable
    assert registry.reserved(2) and registry.slot_of(2) == slot
    lease = registry.acquire_lease(2, "receiver-a", ttl_seconds=10, before_readable=True)
    assert registry.next_expiry() is None  # nothing to wait for: its slot is reserved anyway
    clock.now += 100  # a long step
    registry.renew_lease(lease.lease_id, ttl_seconds=10, receiver_id="receiver-a")
    clock.now += 100
    registry.publish(2, 0, "shards of rank 0")
    assert not registry.reserved(2)
    assert registry.next_expiry() == clock.now + 10
    third = publish_all(registry, 3)
    assert publish_all(registry, 4) == third != slot  # not version 2's: it is leased
    clock.now += 9
    registry.release_lease(lease.lease_id, receiver_id="receiver-a")
    leased = registry.acquire_lease(4, "receiver-a", ttl_seconds=10)
    clock.now += 11
    with pytest.raises(UnknownLease):
        registry.renew_lease(leased.lease_id, ttl_seconds=10, receiver_id="receiver-a")


def test_all_slots_leased_raises_and_an_expired_lease_frees_its_slot():
    clock = Clock()
    registry = make(num_slots=1, clock=clock)
    publish_all(registry, 1)
    lease = registry.acquire_lease(1, "receiver-a", ttl_seconds=10)
    with pytest.raises(SlotsExhausted, match="leased versions \\[1\\]"):
        registry.reserve_slot(2)
    assert registry.next_expiry() == lease.expires_at
    clock.now += 9
    registry.renew_lease(lease.lease_id, ttl_seconds=10, receiver_id="receiver-a")
    clock.now += 9
    with pytest.raises(SlotsExhausted):
        registry.reserve_slot(2)
    clock.now += 2
    assert registry.reserve_slot(2) == (0, 1)
    with pytest.raises(UnknownLease):
        registry.renew_lease(lease.lease_id, ttl_seconds=10, receiver_id="receiver-a")


def test_bad_requests_are_refused():
    registry = make(max_lease_seconds=60)
    publish_all(registry, 3)
    with pytest.raises(ValueError, match="not newer"):
        registry.reserve_slot(2)
    with pytest.raises(ValueError, match="already reserved"):
        registry.reserve_slot(3)
    with pytest.raises(ValueError, match="ttl"):
        registry.acquire_lease(3, "r", ttl_seconds=600)
    with pytest.raises(UnknownVersion):
        registry.acquire_lease(7, "r", ttl_seconds=5)
    with pytest.raises(UnknownLease):
        registry.release_lease("lease-404", receiver_id="r")
    with pytest.raises(ValueError, match="needs a receiver id"):
        registry.acquire_lease(3, "", ttl_seconds=5)
    registry.reserve_slot(4)
    with pytest.raises(ValueError, match="outside the world"):
        registry.publish(4, 5, "x")


def test_a_new_trainer_generation_retires_everything():
    registry = make()
    registry.reserve_slot(1)
    registry.publish(1, 0, "x")
    lease = registry.acquire_lease(1, "r", ttl_seconds=5)
    registry.register_trainer(TrainerShape(world_size=2, num_slots=3))
    assert registry.latest is None
    with pytest.raises(UnknownVersion):
        registry.visible(1)
    with pytest.raises(UnknownLease):
        registry.release_lease(lease.lease_id, receiver_id="r")
    assert registry.reserve_slot(1) == (0, None)


def test_nothing_is_reserved_before_a_trainer_registers():
    with pytest.raises(NotRegistered, match="no trainer has registered"):
        Registry(RegistryConfig()).reserve_slot(1)


def test_a_reservation_waits_until_the_previous_version_is_readable():
    registry = make(world_size=2, num_slots=2)
    publish_all(registry, 1)
    registry.reserve_slot(2)
    registry.publish(2, 1, "rank 1's report arrived first")
    with pytest.raises(PublicationPending, match=r"version 2 .* ranks \[0\] have not reported"):
        registry.reserve_slot(3)
    assert registry.latest == 1  # not retired while its successor is not readable
    registry.publish(2, 0, "rank 0's report")
    assert registry.reserve_slot(3) == (0, 1)


def test_a_version_no_rank_published_can_be_reserved_again():
    registry = make(world_size=2, num_slots=1)
    assert registry.reserve_slot(1) == (0, None)
    assert registry.reserve_slot(1) == (0, None)  # its step failed before publishing; retried
    registry.publish(1, 0, "x")
    with pytest.raises(ValueError, match="already reserved"):
        registry.reserve_slot(1)


def test_with_one_slot_no_version_is_readable_while_its_successor_is_published():
    registry = make(world_size=1, num_slots=1)
    publish_all(registry, 1)
    assert registry.reserve_slot(2) == (0, 1)
    assert registry.latest is None
    with pytest.raises(UnknownVersion, match="readable now: \\[\\]"):
        registry.visible(1)
    registry.publish(2, 0, "x")
    assert registry.latest == 2


def test_a_reservation_ahead_keeps_the_latest_version_and_never_waits():
    registry = make(num_slots=2)
    publish_all(registry, 1)
    assert registry.reserve_slot(2, ahead=True) == (1, None)  # a never-used slot
    registry.publish(2, 0, "x")
    assert registry.reserve_slot(3, ahead=True) == (0, 1)  # the older version, not the latest
    registry.publish(3, 0, "x")
    lease = registry.acquire_lease(2, "r", ttl_seconds=30)
    with pytest.raises(SlotsExhausted, match=r"ahead for version 4: the latest .* is 3"):
        registry.reserve_slot(4, ahead=True)  # 2 is leased, 3 is the latest
    assert registry.reserve_slot(4) == (0, 3)  # at the step, the latest may go
    registry.release_lease(lease.lease_id, receiver_id="r")

    single = make(num_slots=1)
    publish_all(single, 1)
    with pytest.raises(SlotsExhausted):
        single.reserve_slot(2, ahead=True)
    assert single.latest == 1


def test_only_its_holder_renews_or_releases_a_lease_and_ids_are_unguessable():
    clock = Clock()
    registry = make(num_slots=1, clock=clock)
    publish_all(registry, 1)
    lease = registry.acquire_lease(1, "receiver-a", ttl_seconds=10)
    other = registry.acquire_lease(1, "receiver-b", ttl_seconds=10)
    assert lease.lease_id != other.lease_id and len(lease.lease_id) >= 20
    for call in (
        lambda: registry.renew_lease(lease.lease_id, ttl_seconds=600, receiver_id="receiver-b"),
        lambda: registry.release_lease(lease.lease_id, receiver_id="receiver-b"),
    ):
        # The same refusal as for a lease that does not exist: nothing about it leaks.
        with pytest.raises(UnknownLease, match=r"^receiver 'receiver-b' holds no lease"):
            call()
    assert registry.next_expiry() == lease.expires_at  # unchanged
    registry.release_lease(other.lease_id, receiver_id="receiver-b")
    clock.now += 5
    assert registry.renew_lease(lease.lease_id, ttl_seconds=10, receiver_id="receiver-a")
    registry.release_lease(lease.lease_id, receiver_id="receiver-a")
    assert registry.next_expiry() is None


def test_one_owner_at_a_time_and_a_replaced_trainer_is_fenced_off():
    clock = Clock()
    registry = Registry(RegistryConfig(trainer_ttl_seconds=10), clock)
    first = registry.register_trainer(TrainerShape(world_size=2, num_slots=2), "trainer-a")
    registry.reserve_slot(1, generation=first)
    registry.publish(1, 0, "rank 0 of a", generation=first)
    # A second trainer (here: a world of one) is refused while the first renews.
    with pytest.raises(RegistrationHeld, match="registered to trainer 'trainer-a'"):
        registry.register_trainer(TrainerShape(world_size=1, num_slots=1), "stranger")
    clock.now += 9
    registry.renew(first)
    clock.now += 9
    with pytest.raises(RegistrationHeld):
        registry.register_trainer(TrainerShape(world_size=1, num_slots=1), "stranger")
    assert registry.reserved(1) and registry.generation == first  # nothing changed
    # The same owner may register again at any time (a new generation).
    again = registry.register_trainer(TrainerShape(world_size=2, num_slots=2), "trainer-a")
    assert again == first + 1
    # Taking over replaces it: the first trainer's calls are refused from then on, so its
    # ranks can never complete a version of the new world with their shards.
    second = registry.register_trainer(
        TrainerShape(world_size=1, num_slots=1), "stranger", take_over=True
    )
    registry.reserve_slot(1, generation=second)
    for call in (
        lambda: registry.publish(1, 0, "rank 0 of a", generation=again),
        lambda: registry.reserve_slot(2, generation=again),
        lambda: registry.renew(again),
    ):
        with pytest.raises(Superseded, match="registered generation"):
            call()
    assert registry.reserved(1) and registry.latest is None
    # Presenting the current generation replaces it too; an owner that stopped renewing
    # lapses after the TTL.
    third = registry.register_trainer(
        TrainerShape(world_size=2, num_slots=2), "operator", generation=second
    )
    clock.now += 10
    fourth = registry.register_trainer(TrainerShape(world_size=2, num_slots=2), "trainer-a")
    assert (third, fourth) == (second + 1, second + 2)


def test_generations_start_anew_in_each_life_of_the_sidecar():
    # A token from an earlier life of the sidecar (before a restart) is never current.
    first = Registry(RegistryConfig()).register_trainer(TrainerShape(world_size=1, num_slots=1))
    second = Registry(RegistryConfig()).register_trainer(TrainerShape(world_size=1, num_slots=1))
    assert first != second


def test_renewal_lists_the_ranks_each_pending_version_misses_and_abandoning_frees_its_slot():
    registry = make(world_size=3, num_slots=1)
    generation = registry.generation
    registry.reserve_slot(1, generation=generation)
    registry.publish(1, 1, "rank 1", generation=generation)
    lease = registry.acquire_lease(1, "early", ttl_seconds=5, before_readable=True)
    status = registry.renew(generation)
    assert status.pending == (PendingVersion(1, (0, 2)),) and status.latest is None
    with pytest.raises(PublicationPending):
        registry.reserve_slot(2, generation=generation)
    # The trainer gave up on version 1: it is retired, never readable, its early lease ends.
    assert registry.reserve_slot(2, generation=generation, abandoned=(1,)) == (0, None)
    assert not registry.reserved(1)
    with pytest.raises(UnknownLease):
        registry.release_lease(lease.lease_id, receiver_id="early")
    with pytest.raises(UnknownVersion):
        registry.publish(1, 0, "late", generation=generation)


def test_a_report_sent_again_after_the_version_became_readable_counts_once():
    registry = make(world_size=2)
    registry.reserve_slot(1)
    registry.publish(1, 0, "rank 0")
    assert registry.publish(1, 1, "rank 1") is True
    assert registry.publish(1, 1, "rank 1") is False  # its answer was lost; sent again
    assert registry.latest == 1
