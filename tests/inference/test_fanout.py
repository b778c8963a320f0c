"""Tree fan-out across processes: a real TP=2 trainer publishes each version to a sidecar
(at most 2 children per source), and receiver processes of mixed layouts pull it through the
source tree over NIXL, pipelined in small chunks, serving their copies to each other.

One stack serves every test of the module (the CI machine has two cores): the sidecar, the
trainer, six persistent receiver processes of layouts TP=1/TP=2, and a zygote that forks
receivers which SIGKILL themselves mid-pull (`tests/support/fanout_puller.py`). Every refit is
checked bit for bit against the trainer's own HF export.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from refit_sidecar.service.client import SidecarClient, UnknownVersion
from tests.support.fanout_puller import (
    Failed,
    Fetched,
    PullerConfig,
    PullerProcess,
    RankResult,
    Zygote,
)
from tests.support.fidelity import train_step
from tests.support.sidecar import Sidecar, running_sidecar
from tests.support.trainer import TrainerProcess
from trainer_svc.server.publication_health import SERVICE_NAME

LAYOUTS = (1, 2, 1, 2, 1, 1)
"""TP sizes of the persistent receiver processes: 8 tree nodes."""
MAX_CHILDREN = 2
SLOTS = 4
"""Trainer snapshot slots: the version being pulled, and those dead victims still lease."""
TRAINER_PREFIX = "trainer-rank"
KILL_FRACTIONS = (0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95)
VICTIM_THROTTLE_S = 0.01
"""Per progress call (about a hundred per pull): a victim's whole pull would last ~1 s."""
VICTIM_LEASE_S = 5.0
"""A dead victim's lease pins its version's snapshot slot until it runs out."""
CORRUPTER_LEASE_S = 30.0
"""The corrupting parent lives through its test: a lease this long survives renewals delayed
on a loaded machine, so the child is never given another parent because the corrupter's lapsed."""
EDGE_WAIT_S = 30.0
"""How long a child may take to be given the corrupting parent and start reading from it (a
loaded machine starts a pull slowly)."""
RECOVERY_S = 10.0
"""How soon after its parent's death a child must complete (stall_timeout_s is 2 s)."""


@dataclass
class Stack:
    root: Path
    sidecar: Sidecar
    trainer: TrainerProcess
    model_dir: Path
    pullers: list[PullerProcess]
    zygote: Zygote
    client: SidecarClient
    _steps: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def config(self, receiver_id: str, tp_size: int, **options: Any) -> PullerConfig:
        return _config(self.sidecar, self.model_dir, receiver_id, tp_size, **options)

    def new_version(self) -> tuple[int, dict[str, np.ndarray]]:
        """Train one step; the new version and the trainer's HF export of it."""
        step = next(self._steps)
        version = train_step(self.trainer, f"s{step}", seed=step)
        return version, self.trainer.export(f"v{version}")


def _config(
    sidecar: Sidecar, model_dir: Path, receiver_id: str, tp_size: int, **options: Any
) -> PullerConfig:
    return PullerConfig(
        sidecar=sidecar.address,
        token_file=sidecar.token_file(),
        model_dir=str(model_dir),
        receiver_id=receiver_id,
        tp_size=tp_size,
        **options,
    )


def _wait_publishing(trainer: TrainerProcess, timeout: float = 120.0) -> None:
    """Until the trainer reports that it reaches the sidecar (its publication health)."""
    health = health_pb2_grpc.HealthStub(trainer.channel)
    request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if health.Check(request).status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        assert time.monotonic() < deadline, "the trainer never reached the sidecar"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("fanout")
    flags = ("--max-children", str(MAX_CHILDREN), "--max-root-children", str(MAX_CHILDREN))
    with running_sidecar(root / "sidecar", *flags, log_path=root / "sidecar.log") as sidecar:
        trainer_dir = root / "trainer"
        model_dir = trainer_dir / "builtin-model"
        args = ["--tp", "2", *sidecar.trainer_args(), "--refit-slots", str(SLOTS)]
        zygote: Zygote | None = None
        pullers: list[PullerProcess] = []
        pool = ThreadPoolExecutor(max_workers=1)
        starting = pool.submit(TrainerProcess, trainer_dir, args)
        pool.shutdown(wait=False)
        try:
            # The workers import torch and NIXL while the trainer starts; they wait for the
            # trainer's model config before building their receivers.
            zygote = Zygote()
            for i, tp in enumerate(LAYOUTS):
                pullers.append(PullerProcess(_config(sidecar, model_dir, f"r{i}", tp)))
            trainer = starting.result()
            zygote.wait_ready()
            for puller in pullers:
                puller.wait_ready()
            _wait_publishing(trainer)
            client = sidecar.client()
            try:
                yield Stack(root, sidecar, trainer, model_dir, pullers, zygote, client)
            finally:
                client.close()
        finally:
            # Everything at once: each takes a few seconds to close its NIXL agents.
            stops = [p.stop for p in pullers] + ([zygote.stop] if zygote is not None else [])
            with ThreadPoolExecutor(max_workers=len(stops) + 1) as closing:
                for stop in stops:
                    closing.submit(stop)
                # Also when the test was interrupted while the trainer started.
                if starting.exception() is None:
                    assert closing.submit(starting.result().stop).result() == 0


def _ranks(outcome: Any, who: str) -> tuple[RankResult, ...]:
    assert isinstance(outcome, Fetched), f"{who}: the refit failed: {outcome}"
    return outcome.ranks


def _assert_exact(ranks: tuple[RankResult, ...], exported: dict[str, np.ndarray]) -> None:
    """Every installed slice is the same box of the trainer's export, bit for bit, and each
    rank installed something of every tensor its layout keeps."""
    for rank in ranks:
        assert rank.slices, f"{rank.agent} installed nothing"
        for name, (ranges, values) in rank.slices.items():
            expected = exported[name][tuple(slice(a, b) for a, b in ranges)]
            assert values.dtype == expected.dtype, (rank.agent, name)
            assert np.array_equal(values, expected), f"{rank.agent}: {name} differs"


def _summary(stats: dict[str, Any], origin: float) -> str:
    sources = ", ".join(f"{s} {n} B" for s, n in sorted(stats["bytes_by_source"].items()))
    return (
        f"{stats['tp_rank']}: {stats['bytes_pulled']} B from [{sources}], "
        f"{stats['pull_started'] - origin:+.3f} s .. {stats['pull_finished'] - origin:+.3f} s, "
        f"{stats['fallbacks']} fallbacks"
    )


def test_six_receiver_processes_refit_through_a_pipelined_tree(stack: Stack) -> None:
    version, exported = stack.new_version()
    for puller in stack.pullers:
        puller.fetch(version, throttle_s=0.002)
    stats: dict[str, dict[str, Any]] = {}
    for puller in stack.pullers:
        ranks = _ranks(puller.result(), puller.config.receiver_id)
        assert [r.agent for r in ranks] == list(puller.agents)
        _assert_exact(ranks, exported)
        stats.update((r.agent, r.stats) for r in ranks)
    assert len(stats) == sum(LAYOUTS) == 8
    assert all(s["version"] == version and s["fallbacks"] == 0 for s in stats.values())

    origin = min(s["pull_started"] for s in stats.values())
    for agent, s in stats.items():
        print(f"\n{agent} (tp rank {_summary(s, origin)})", end="")
    listing = stack.client.list_tree(version)
    print("\n" + listing.describe())

    # Each trainer rank feeds at most MAX_CHILDREN receivers at a time: of those that read
    # from it, no more pulled at once.
    model_bytes = stats["r0-tp0"]["bytes_pulled"]
    assert model_bytes > 0
    assert {stats[f"r{i}-tp0"]["bytes_pulled"] for i, tp in enumerate(LAYOUTS) if tp == 1} == {
        model_bytes
    }
    ranks = {
        src
        for s in stats.values()
        for src in s["bytes_by_source"]
        if src.startswith(TRAINER_PREFIX)
    }
    for rank in ranks:
        windows = [
            (s["pull_started"], s["pull_finished"])
            for s in stats.values()
            if rank in s["bytes_by_source"]
        ]
        at_once = max(sum(a <= t < b for a, b in windows) for t, _ in windows)
        assert at_once <= MAX_CHILDREN, (rank, windows)
    # So while every receiver pulls at the same time, the trainer serves at most two whole
    # models and the rest comes from peers. (A receiver that asks after others finished may
    # take the slots they freed: a loaded machine spreads the first fetches out.)
    from_trainer = sum(
        n
        for s in stats.values()
        for source, n in s["bytes_by_source"].items()
        if source.startswith(TRAINER_PREFIX)
    )
    together = max(s["pull_started"] for s in stats.values()) < min(
        s["pull_finished"] for s in stats.values()
    )
    assert from_trainer > 0, from_trainer
    if together:
        assert from_trainer <= 2 * model_bytes, (from_trainer, model_bytes)
    assert listing.depth >= 2, listing.describe()

    # The tree's edges are exactly who read from whom.
    parents: dict[str, set[str]] = {}
    for edge in listing.edges:
        parents.setdefault(edge.child, set()).add(edge.parent)
    for agent, s in stats.items():
        assert set(s["bytes_by_source"]) == parents.get(agent, set()), (agent, listing.describe())
        assert all(n > 0 for n in s["bytes_by_source"].values()), agent

    # Pipelined: some child started reading before its (receiver) parent had finished.
    overlapping = [
        (edge.parent, edge.child)
        for edge in listing.edges
        if edge.parent in stats
        and stats[edge.child]["pull_started"] < stats[edge.parent]["pull_finished"]
    ]
    assert overlapping, listing.describe()
    # Every pull read for some time, and its chunk requests were prepared for it (the first
    # version these receivers pull); a child whose parent was still filling waited on it.
    assert all(s["reading_s"] > 0 and s["prepared"] > 0 for s in stats.values())
    assert any(stats[child]["gated_s"] > 0 for _, child in overlapping), listing.describe()


def test_a_fetch_of_a_version_that_never_comes_fails_and_leaves_nothing_behind(
    stack: Stack,
) -> None:
    """A receiver asks for its sources beside its lease: when the version does not come,
    both fail, nothing stays assigned, and its next fetch asks ahead again and is exact."""
    puller = stack.pullers[1]
    version, exported = stack.new_version()
    puller.fetch(version)
    _assert_exact(_ranks(puller.result(), "first"), exported)
    puller.fetch(version + 1, visible_timeout_s=0.5)
    failed = puller.result()
    assert isinstance(failed, Failed) and "cannot lease" in failed.error, failed
    later, exported = stack.new_version()
    assert later == version + 1
    assert not set(puller.agents) & {n.node_id for n in stack.client.list_tree(later).nodes}
    puller.fetch(later)
    ranks = _ranks(puller.result(), "after the failed fetch")
    _assert_exact(ranks, exported)
    assert all(r.stats["asked_ahead"] for r in ranks), [r.stats for r in ranks]


def _tree_nodes(stack: Stack, version: int) -> set[str]:
    return {n.node_id for n in stack.client.list_tree(version).nodes}


def test_a_receiver_that_expects_a_version_reads_it_the_moment_it_is_published(
    stack: Stack,
) -> None:
    """`Receiver.expect`: receivers ask for the next version's lease and sources before the
    trainer has it; the sidecar assigns nothing until it is readable, then answers at once,
    and the fetches that follow read without asking again, exact. An expected version that is
    not fetched leaves nothing in the tree: an answered call's assignment is released, a
    waiting one is cancelled."""
    a, b = stack.pullers[4], stack.pullers[3]  # TP=1 and TP=2
    version, exported = stack.new_version()
    for puller in (a, b):
        puller.fetch(version)
    for puller in (a, b):
        _assert_exact(_ranks(puller.result(), puller.config.receiver_id), exported)

    for puller in (a, b):
        puller.expect(version + 1)
    with pytest.raises(UnknownVersion):
        stack.client.list_tree(version + 1)  # not readable yet: nothing assigned
    expected, exported = stack.new_version()
    assert expected == version + 1
    for puller in (a, b):
        puller.fetch(expected)
    for puller in (a, b):
        ranks = _ranks(puller.result(), f"{puller.config.receiver_id} expecting")
        _assert_exact(ranks, exported)
        assert all(r.stats["expected"] and r.stats["asked_ahead"] for r in ranks), [
            r.stats for r in ranks
        ]
        # The sidecar's times, on this host's clock: readable, answered, in the receiver's hand.
        for r in ranks:
            s = r.stats
            assert 0 < s["sidecar_readable_at"] <= s["sidecar_answered_at"] <= s["leased_at"], s
        assert len({r.stats["sidecar_readable_at"] for r in ranks}) == 1

    # Answered, then not used: a fetches a later version instead.
    a.expect(expected + 1)
    skipped, _ = stack.new_version()
    deadline = time.monotonic() + 10
    while not set(a.agents) <= _tree_nodes(stack, skipped):
        assert time.monotonic() < deadline, "the expected version was never assigned"
        time.sleep(0.01)
    later, exported = stack.new_version()
    a.fetch(later)
    ranks = _ranks(a.result(), "after an expected version it skipped")
    _assert_exact(ranks, exported)
    assert not any(r.stats["expected"] for r in ranks)
    assert not set(a.agents) & _tree_nodes(stack, skipped)

    # Still waiting, then dropped: b expects one version, then another; the first is
    # cancelled before it comes and the second when b fetches the first.
    b.expect(later + 1)
    b.expect(later + 2)
    dropped, exported = stack.new_version()
    assert dropped == later + 1
    time.sleep(0.2)  # time for a call that was not cancelled to be answered
    assert not set(b.agents) & _tree_nodes(stack, dropped)
    b.fetch(dropped)
    _assert_exact(_ranks(b.result(), "after dropping its expectations"), exported)
    following, _ = stack.new_version()
    time.sleep(0.2)
    assert not set(b.agents) & _tree_nodes(stack, following)


@dataclass(frozen=True)
class Round:
    fraction: float
    child: int
    """Index of the child's receiver process (a TP=1 or a TP=2 one)."""


ROUNDS = tuple(Round(f, 1 if i in (3, 7) else 2) for i, f in enumerate(KILL_FRACTIONS))
FILLER = 0


def _wait_for_edge(
    stack: Stack, version: int, parent: str, children: tuple[str, ...], timeout: float = 10.0
) -> str | None:
    """Until the sidecar lists `parent` -> one of `children` for `version`: that child (it
    has its sources); None if none does within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for edge in stack.client.list_tree(version).edges:
            if edge.parent == parent and edge.child in children:
                return edge.child
        time.sleep(0.01)
    return None


def test_a_parent_killed_mid_pull_is_replaced_and_every_refit_stays_exact(
    stack: Stack,
) -> None:
    filler = stack.pullers[FILLER]
    read_from_victim = 0
    unaccounted: list[str] = []
    for number, plan in enumerate(ROUNDS):
        child = stack.pullers[plan.child]
        version, exported = stack.new_version()
        # The victim first: it takes a slot on each trainer rank and offers its copy, but
        # holds at its first chunk until its child is reading from it.
        gate = stack.root / f"gate-{number}"
        victim = stack.zygote.victim(
            stack.config(f"victim{number}", 1, lease_ttl_s=VICTIM_LEASE_S),
            version,
            kill_at=plan.fraction,
            throttle_s=VICTIM_THROTTLE_S,
            gate=gate,
        )
        started = victim.wait_started()
        agent = started.agent
        # The filler takes the trainer's other slots; the child then gets the victim (the
        # earliest registered of the two filling peers with room).
        filler.fetch(version, throttle_s=VICTIM_THROTTLE_S)
        filler.wait_started()
        child.fetch(version)
        reader = _wait_for_edge(stack, version, agent, child.agents)
        if reader is not None:
            # Its first chunk came from the victim (all the victim holds yet): the child's
            # NIXL connection to the victim is up.
            child.wait_started(reader, timeout=10.0)
        victim.release()

        exited, last_words = victim.wait_exit()
        ranks = _ranks(child.result(), f"round {number}: child")
        filled = _ranks(filler.result(), f"round {number}: filler")
        _assert_exact(ranks, exported)
        _assert_exact(filled, exported)
        if number:
            # A receiver that pulled before asks for its sources beside its lease.
            assert all(r.stats["asked_ahead"] for r in filled), [r.stats for r in filled]

        # The victim died by SIGKILL, mid-pull, at the fraction it was given.
        assert exited.code == -9, f"round {number}: the victim exited with {exited.code}"
        assert len(last_words) == 1, last_words
        killed = last_words[0]
        assert killed.filled < killed.total
        assert killed.filled >= plan.fraction * killed.total

        from_victim = sum(r.stats["bytes_by_source"].get(agent, 0) for r in ranks)
        finished = max(r.stats["pull_finished"] for r in ranks)
        print(
            f"\nround {number}: killed at {killed.filled}/{killed.total} B "
            f"(read by {reader}); child read {from_victim} B from it, finished "
            f"{finished - killed.at:+.2f} s after; "
            + "; ".join(
                f"{r.agent} {r.stats['bytes_by_source']} {r.stats['fallbacks']} fallbacks"
                for r in ranks
            ),
            end="",
        )
        for rank in ranks:
            s = rank.stats
            if s["bytes_by_source"].get(agent, 0) and killed.at < s["pull_finished"]:
                assert s["fallbacks"] >= 1, (number, rank.agent, s)
        assert finished - killed.at < RECOVERY_S, (number, finished - killed.at)
        read_from_victim += from_victim > 0
        if len(ranks) == 1:
            # Every staged byte came from some source: the sources' bytes add up to what
            # the filler (same layout, read from the trainer in one go) pulled.
            whole = filled[0].stats["bytes_pulled"]
            counted = sum(ranks[0].stats["bytes_by_source"].values())
            if counted != whole:
                # The bytes that went missing landed from a source lost later: a fallback.
                assert ranks[0].stats["fallbacks"] >= 1, (number, ranks[0].stats)
                unaccounted.append(f"round {number}: {counted} of {whole} B attributed")
    # Checked last, so that every round's other checks ran first.
    assert not unaccounted, (
        "bytes_by_source leaves out bytes read from a source lost later: " + "; ".join(unaccounted)
    )
    assert read_from_victim >= len(ROUNDS) - 2, read_from_victim


def test_a_parent_serving_a_corrupted_copy_fails_its_childs_refit_closed(stack: Stack) -> None:
    """A parent whose copy holds a flipped byte (flipped before anyone read it) fails its own
    check, and its child, which read that byte, fails its refit naming the parent rather than
    install what it read: it saw the parent's copy fail, or (when it checks every byte against
    the trainer's checksums itself, not waiting for its parent's check) its own check failed.
    The child's next refit is exact again."""
    filler = stack.pullers[FILLER]
    child = stack.pullers[1]
    version, first = stack.new_version()
    gate = stack.root / "gate-corrupt"
    victim = stack.zygote.victim(
        stack.config("corrupter", 2, lease_ttl_s=CORRUPTER_LEASE_S),
        version,
        corrupt=True,
        throttle_s=VICTIM_THROTTLE_S,
        gate=gate,
    )
    agent = victim.wait_started().agent
    filler.fetch(version, throttle_s=VICTIM_THROTTLE_S)
    filler.wait_started()
    child.fetch(version)
    reader = _wait_for_edge(stack, version, agent, child.agents, timeout=EDGE_WAIT_S)
    assert reader is not None, "the child was not given the corrupting parent"
    child.wait_started(reader, timeout=EDGE_WAIT_S)
    victim.release()
    outcome = child.result()
    assert isinstance(outcome, Failed), outcome
    assert "corrupter-tp" in outcome.error, outcome.error
    parent = victim.result()
    assert isinstance(parent, Failed) and "crc32" in parent.error, parent
    exited, _ = victim.wait_exit()
    assert exited.code == 0
    # The filler may have read from the corrupter too (either of its ranks): exact, or failed
    # like the child.
    filled = filler.result()
    if isinstance(filled, Failed):
        assert "corrupter-tp" in filled.error, filled.error
    else:
        _assert_exact(filled.ranks, first)
    version, exported = stack.new_version()
    child.fetch(version)
    _assert_exact(_ranks(child.result(), "the child, a version later"), exported)
