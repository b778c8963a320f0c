"""Tree fan-out through a real refit-sidecar process: GetSources routes and source copies,
peers serving later receivers, lost peers, the drain of an older copy, ReleaseSources, ListTree,
the error codes, a new trainer generation, the CLI flags and receiver-role access."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest

from refit_sidecar.core.manifest import (
    AgentRecord,
    Box,
    DType,
    Manifest,
    ParameterRecord,
    ShardLocation,
    ShardPiece,
    ShardRecord,
)
from refit_sidecar.core.plan import Want
from refit_sidecar.core.shared_word_ref import ProgressFileRef
from refit_sidecar.core.tree_records import CopyState, NodeInfo, NodeKind, TreeConfig
from refit_sidecar.service.cli import parse_config
from refit_sidecar.service.client import (
    SidecarClient,
    TrainerLayout,
    UnknownVersion,
    lease_from_proto,
)
from refit_sidecar.service.pending import Pending
from refit_sidecar.service.sources import (
    Answer,
    NoLiveSource,
    NoSourceFree,
    Offer,
    Sources,
    get_sources_request,
)
from refit_sidecar.service.wire import box_to_proto, location_to_proto
from tests.support.sidecar import Sidecar, running_sidecar
from trainer_refit.auth import Role
from trainer_refit.errors import InvalidRequest
from trainer_refit.v1 import refit_pb2 as pb
from trainer_refit.v1 import refit_pb2_grpc as pb_grpc

F32 = DType.FLOAT32
RANKS = ("rank-0", "rank-1")
W_CRC = (100, 101)


def _rank_part(version: int, rank: int) -> Manifest:
    """Rank `rank` of a TP=2 trainer. w (8, 4): rows [4r, 4r+4) in a buffer of exactly that
    box, with a CRC; fc1 (8, 4): [gate_r; up_r], two pieces in one buffer, with a CRC; rank 0
    only: norm (4,) whole without a CRC, bias (4,) in a padded buffer with a CRC, gap (4,) of
    which only [0, 2) is published, extra (2,) that nobody wants."""
    agent = RANKS[rank]
    base = 1 << 20 * (rank + 1)

    def loc(offset: int, shape: tuple[int, ...], nbytes: int | None = None) -> ShardLocation:
        contiguous = ShardLocation.contiguous(
            agent=agent, address=base + offset, shape=shape, itemsize=4
        )
        if nbytes is None:
            return contiguous
        return ShardLocation(
            agent=agent, address=base + offset, nbytes=nbytes, shape=shape, strides=(1,)
        )

    def one(box: Box, location: ShardLocation, crc: int | None) -> ShardRecord:
        return ShardRecord(location, (ShardPiece(box, (0,) * box.ndim),), crc, rank=rank)

    rows = Box(((4 * rank, 4 * rank + 4), (0, 4)))
    params = [
        ParameterRecord("w", (8, 4), F32, (one(rows, loc(0, (4, 4)), W_CRC[rank]),)),
        ParameterRecord(
            "fc1",
            (8, 4),
            F32,
            (
                ShardRecord(
                    loc(4096, (4, 4)),
                    (
                        ShardPiece(Box(((2 * rank, 2 * rank + 2), (0, 4))), (0, 0)),
                        ShardPiece(Box(((4 + 2 * rank, 6 + 2 * rank), (0, 4))), (2, 0)),
                    ),
                    200 + rank,
                    rank=rank,
                ),
            ),
        ),
    ]
    if rank == 0:
        params += [
            ParameterRecord("norm", (4,), F32, (one(Box.full((4,)), loc(8192, (4,)), None),)),
            ParameterRecord(
                "bias", (4,), F32, (one(Box.full((4,)), loc(12288, (4,), nbytes=32), 300),)
            ),
            ParameterRecord("gap", (4,), F32, (one(Box(((0, 2),)), loc(16384, (2,)), 400),)),
            ParameterRecord("extra", (2,), F32, (one(Box.full((2,)), loc(20480, (2,)), 500),)),
        ]
    return Manifest(version, tuple(params), {agent: AgentRecord(agent, b"meta", rank=rank)})


# A TP=2 rank-0 receiver's boxes (what rank-0 holds) and a TP=1 receiver's (everything).
HALF = [
    Want("w", Box(((0, 4), (0, 4)))),
    Want("fc1", Box(((0, 2), (0, 4)))),
    Want("fc1", Box(((4, 6), (0, 4)))),
    Want("norm", Box.full((4,))),
    Want("bias", Box.full((4,))),
]
WHOLE = [Want("w", Box.full((8, 4))), Want("fc1", Box.full((8, 4))), Want("norm", Box.full((4,)))]


def offer(receiver: str, wants: list[Want], address: int = 1 << 30) -> Offer:
    """The receiver's staging: the wants back to back in C order, then the progress word."""
    locations = []
    for want in wants:
        location = ShardLocation.contiguous(
            agent=receiver, address=address, shape=want.box.shape, itemsize=4
        )
        locations.append(location)
        address += location.nbytes
    progress = ShardLocation.contiguous(agent=receiver, address=address, shape=(24,), itemsize=1)
    return Offer(AgentRecord(receiver, b"peer-meta"), tuple(locations), progress)


@dataclass
class Fleet:
    """A running sidecar with a TP=2 trainer registered and a receiver-role client."""

    sidecar: Sidecar
    trainer: SidecarClient
    client: SidecarClient
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def stub(self) -> pb_grpc.RefitServiceStub:
        return self.sidecar.stub(Role.RECEIVER)

    def publish(self, version: int) -> None:
        self.trainer.reserve_slot(version)
        for rank in range(2):
            self.trainer.publish(version, rank, _rank_part(version, rank))

    def register(self, slots: int = 2) -> None:
        self.trainer.register_trainer(
            TrainerLayout(tensor_parallel=2), num_slots=slots, owner="fleet"
        )

    def nodes(self, version: int = 1) -> dict[str, NodeInfo]:
        return {n.node_id: n for n in self.client.list_tree(version).nodes}


@pytest.fixture
def fleet(tmp_path) -> Iterator[Callable[..., Fleet]]:
    numbers = itertools.count()
    with ExitStack() as stack:

        def start(*args: str) -> Fleet:
            n = next(numbers)
            log_path = tmp_path / f"sidecar-{n}.log"
            sidecar = stack.enter_context(
                running_sidecar(tmp_path / f"sidecar-{n}", *args, log_path=log_path)
            )
            trainer = stack.enter_context(sidecar.client(Role.TRAINER, timeout=30))
            client = stack.enter_context(sidecar.client(Role.RECEIVER, timeout=30))
            f = Fleet(sidecar, trainer, client, log_path)
            f.register()
            f.publish(1)
            return f

        yield start


def _primaries(sources: Sources) -> set[str]:
    return {r.primary for r in sources.routes}


def test_a_first_receiver_reads_from_the_trainer_ranks_each_copy_its_own_shards(fleet):
    f = fleet()
    sources = f.client.get_sources(1, "r1", WHOLE)
    assert sources.version == 1 and sources.offer_expires_in_s == 0
    # Per want, in order, pieces tiling it: w and fc1 from both ranks, norm from rank 0.
    by_want = [(r.name, r.box.ranges, r.primary) for r in sources.routes]
    assert by_want == [
        ("w", ((0, 4), (0, 4)), "rank-0"),
        ("w", ((4, 8), (0, 4)), "rank-1"),
        ("fc1", ((0, 2), (0, 4)), "rank-0"),
        ("fc1", ((2, 4), (0, 4)), "rank-1"),
        ("fc1", ((4, 6), (0, 4)), "rank-0"),
        ("fc1", ((6, 8), (0, 4)), "rank-1"),
        ("norm", ((0, 4),), "rank-0"),
    ]
    assert set(sources.copies) == set(RANKS)
    for rank, agent in enumerate(RANKS):
        copy = sources.copies[agent]
        assert copy.kind is NodeKind.TRAINER and copy.progress is None
        assert list(copy.shards.agents) == [agent]
        assert copy.shards.agents[agent].metadata == b"meta"
        # Only the wanted tensors (not bias, gap, extra), only this agent's shards.
        assert set(copy.shards.names) == ({"w", "fc1", "norm"} if rank == 0 else {"w", "fc1"})
        # Where the bytes lie, without checksums (the lease brings the trainer's): the same
        # copy for every version laid out alike.
        expected = _rank_part(1, rank)
        for parameter in copy.shards.parameters:
            bare = tuple(replace(s, crc32=None, sum64=None) for s in parameter.shards)
            assert parameter == replace(expected.get(parameter.name), shards=bare)
        assert expected.get("w").shards[0].crc32 == W_CRC[rank]  # the rank published it
    assert copy.shards.version == 0
    listing = f.client.list_tree(1)
    assert {(e.parent, e.child, e.active) for e in listing.edges} == {
        ("rank-0", "r1", True),
        ("rank-1", "r1", True),
    }
    assert f.nodes()["r1"].kind is NodeKind.RECEIVER and listing.depth == 1


def test_a_later_receiver_reads_from_a_peer_whose_copy_says_only_where_its_bytes_lie(fleet):
    f = fleet("--max-root-children", "1")
    mirror = ProgressFileRef("host-a", "/dev/shm/trainer-refit-progress.3.7.0123456789abcdef")
    offered = replace(offer("p1", HALF), progress_file=mirror)
    first = f.client.get_sources(1, "p1", HALF, domain="n0", offer=offered)
    assert _primaries(first) == {"rank-0"}
    assert 0 < first.offer_expires_in_s <= TreeConfig().peer_ttl_s

    second = f.client.get_sources(1, "r2", HALF[:3] + HALF[4:])
    assert _primaries(second) == {"p1"}
    for route in second.routes:  # the grandparent, then the trainer ranks holding it
        assert route.fallbacks[0] == "rank-0"
    # Only the primaries' copies come: a receiver whose primary fails asks again.
    assert set(second.copies) == {"p1"}
    peer = second.copies["p1"]
    assert peer.kind is NodeKind.PEER
    assert peer.progress == offer("p1", HALF).progress
    assert peer.progress_file == mirror  # its mirror of the word too, for readers on its host
    assert list(peer.shards.agents) == ["p1"]
    assert peer.shards.agents["p1"].metadata == b"peer-meta"
    # One shard per want of the peer (norm too, which r2 does not want: the copy's first byte
    # is where its progress counts from), at its offered location, without checksums (r2
    # checks what it pulls against the trainer's).
    offered = dict(zip(map(str, HALF), offer("p1", HALF).locations, strict=True))
    shards = [
        (p.name, s.pieces[0].box, s.crc32, s.location)
        for p in peer.shards.parameters
        for s in p.shards
    ]
    assert [(n, b, c) for n, b, c, _ in shards] == [
        ("w", HALF[0].box, None),
        ("fc1", HALF[1].box, None),
        ("fc1", HALF[2].box, None),
        ("norm", HALF[3].box, None),
        ("bias", HALF[4].box, None),
    ]
    for name, box, _, location in shards:
        assert location == offered[str(Want(name, box))]
    assert peer.shards.get("w").dtype is F32 and peer.shards.get("w").shape == (8, 4)
    assert all(s.sum64 is None for p in peer.shards.parameters for s in p.shards)

    nodes = f.nodes()
    assert nodes["p1"].kind is NodeKind.PEER and nodes["p1"].state is CopyState.FILLING
    assert (nodes["p1"].depth, nodes["p1"].children, nodes["p1"].domain) == (1, 1, "n0")
    assert (nodes["r2"].kind, nodes["r2"].depth) == (NodeKind.RECEIVER, 2)

    # ReleaseSources: complete makes the copy complete and frees the slot.
    f.client.release_sources(1, "p1", complete=True)
    nodes = f.nodes()
    assert nodes["p1"].state is CopyState.COMPLETE and nodes["rank-0"].children == 0
    edges = {(e.parent, e.child): e.active for e in f.client.list_tree(1).edges}
    assert edges == {("rank-0", "p1"): False, ("p1", "r2"): True}

    # r2 lost p1: p1 is no longer handed out, r2 reads from the trainer; a trainer rank named
    # as lost stays a source.
    third = f.client.get_sources(1, "r2", HALF[:1], lost=["p1", "rank-0"])
    assert _primaries(third) == {"rank-0"} and "p1" not in third.copies
    assert "p1" not in f.nodes()
    log = f.log()
    assert "INFO version 1: 'r2' lost peer 'p1'; its readers fall back: ['r2']" in log
    assert "WARNING version 1: 'r2' lost trainer rank 'rank-0'" in log

    # A failed pull withdraws an offered copy.
    f.client.release_sources(1, "r2", complete=True)
    f.client.get_sources(1, "p3", HALF[:1], offer=offer("p3", HALF[:1]))
    assert f.nodes()["p3"].kind is NodeKind.PEER
    f.client.release_sources(1, "p3", complete=False)
    f.client.release_sources(1, "p3", complete=False)  # twice: nothing changes
    assert "p3" not in f.nodes()
    assert _primaries(f.client.get_sources(1, "r4", HALF[:1])) == {"rank-0"}


def test_a_new_offer_waits_for_the_readers_of_the_older_copy(fleet):
    f = fleet("--max-root-children", "1", "--drain-timeout-seconds", "0.5")
    f.client.get_sources(1, "p1", HALF, offer=offer("p1", HALF))
    assert _primaries(f.client.get_sources(1, "c1", HALF)) == {"p1"}
    f.publish(2)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(f.client.get_sources, 2, "p1", HALF, offer=offer("p1", HALF))
        time.sleep(0.25)
        assert not pending.done()  # c1 still reads p1's copy of version 1
        f.client.release_sources(1, "c1", complete=True)
        assert _primaries(pending.result(timeout=5)) == {"rank-0"}
    assert "p1" not in f.nodes(1)  # withdrawn from version 1 once c1 was done

    # A reader that never releases: the offer goes on after the drain timeout.
    f.client.get_sources(1, "p2", HALF, offer=offer("p2", HALF))
    assert _primaries(f.client.get_sources(1, "c2", HALF)) == {"p2"}
    started = time.monotonic()
    newer = f.client.get_sources(2, "p2", HALF, offer=offer("p2", HALF))
    assert time.monotonic() - started >= 0.5
    assert _primaries(newer) == {"p1"}  # rank-0 feeds p1 in version 2
    nodes = f.nodes(1)
    assert "p2" not in nodes and nodes["c2"].kind is NodeKind.RECEIVER
    assert (
        "WARNING version 1: 'p2' withdraws its copy after 0.5 s while ['c2'] still read" in f.log()
    )
    assert not [e for e in f.client.list_tree(1).edges if e.parent == "p2"]
    # A receiver offering the same version again does not wait.
    started = time.monotonic()
    f.client.get_sources(2, "p2", HALF, offer=offer("p2", HALF))
    assert time.monotonic() - started < 0.4


def test_routing_keys_repeat_where_the_reads_do(fleet):
    """A receiver whose answer reads the same boxes from the same memory gets the same
    routing key for every version (a peer's copy lies where it did, and this trainer
    publishes every version at the same addresses), whatever its fallbacks; a receiver in
    another place of the tree gets another."""
    f = fleet("--max-root-children", "1", "--max-children", "1")
    chain = ("p1", "p2", "p3")
    asked = {}
    for rid in chain:
        asked[(1, rid)] = f.client.get_sources(1, rid, HALF, offer=offer(rid, HALF))
    for rid in chain:
        f.client.release_sources(1, rid, complete=True)
    assert [sorted(_primaries(asked[(1, r)])) for r in chain] == [["rank-0"], ["p1"], ["p2"]]
    for version in (2, 3):
        f.publish(version)
        for rid in chain:
            asked[(version, rid)] = f.client.get_sources(version, rid, HALF, offer=offer(rid, HALF))
        for rid in chain:
            f.client.release_sources(version, rid, complete=True)
        assert [sorted(_primaries(asked[(version, r)])) for r in chain] == [
            ["rank-0"],
            ["p1"],
            ["p2"],
        ]
    keys = {k: a.key for k, a in asked.items()}
    assert keys[(1, "p2")] == keys[(2, "p2")] == keys[(3, "p2")]
    assert keys[(1, "p3")] == keys[(2, "p3")] == keys[(3, "p3")]
    assert keys[(1, "p1")] == keys[(2, "p1")] == keys[(3, "p1")]
    assert len({keys[(1, r)] for r in chain}) == 3
    # The key is the sidecar's: what the answer itself routes, fallbacks left out.
    assert asked[(2, "p3")].routes[0].fallbacks and all(
        isinstance(a.key, bytes) and len(a.key) == 16 for a in asked.values()
    )
    # A receiver naming the key of the plan it holds gets the key alone when it repeats, the
    # whole answer when it does not.
    f.publish(4)
    for rid, known in (("p1", keys[(3, "p1")]), ("p2", keys[(3, "p2")]), ("p3", b"stale")):
        request = get_sources_request(4, rid, HALF, offer=offer(rid, HALF))
        request.known_routing_keys.extend([b"another", known])
        answer = f.client.ask(request)
        if rid == "p3":
            assert not answer.reply.routes_left_out and answer.reply.routes
            assert answer.key == keys[(3, "p3")] and _primaries(answer.sources()) == {"p2"}
        else:
            assert answer.reply.routes_left_out and answer.key == known
            assert not answer.reply.routes and not answer.reply.sources
            assert answer.version == 4 and answer.reply.offer_expires_in_seconds > 0


def _chain_of_two(fleet: Callable[..., Fleet], hold_s: float) -> Fleet:
    """A sidecar holding the tree's shape for `hold_s`, where p1 read version 1 from the
    trainer and p2 from p1; version 2 just published."""
    f = fleet(
        "--max-root-children", "1", "--max-children", "1", "--hold-parents-seconds", str(hold_s)
    )
    for rid in ("p1", "p2"):
        f.client.get_sources(1, rid, HALF, offer=offer(rid, HALF))
    for rid in ("p1", "p2"):
        f.client.release_sources(1, rid, complete=True)
    f.publish(2)
    return f


def test_a_receiver_asking_before_its_previous_parent_is_answered_when_the_parent_asks(fleet):
    """The tree holds its shape: a child asking before its parent of the last version waits
    on the sidecar (no NoSourceFree, no retry) and is answered the moment the parent asks."""
    f = _chain_of_two(fleet, hold_s=20)
    with ThreadPoolExecutor(1) as pool:
        child = pool.submit(f.client.get_sources, 2, "p2", HALF, offer=offer("p2", HALF))
        time.sleep(0.3)
        assert not child.done(), "the child was answered before its parent asked"
        asked = time.monotonic()
        parent = f.client.get_sources(2, "p1", HALF, offer=offer("p1", HALF))
        answer = child.result(timeout=10)
        assert time.monotonic() - asked < 5  # at once, not at the end of the 20 s hold
    assert _primaries(parent) == {"rank-0"} and _primaries(answer) == {"p1"}


def test_a_receiver_whose_previous_parent_skips_a_version_reads_elsewhere_after_the_hold(fleet):
    f = _chain_of_two(fleet, hold_s=0.3)
    asked = time.monotonic()
    answer = f.client.get_sources(2, "p2", HALF, offer=offer("p2", HALF))  # p1 never asks
    assert 0.2 < time.monotonic() - asked < 5
    assert _primaries(answer) == {"rank-0"}
    assert "'p2' waited out the tree's hold" in f.log()
    assert "waits for its previous parent 'p1'" in f.log()


def test_sources_asked_for_a_version_not_yet_readable_come_once_it_is(fleet):
    f = fleet()
    with pytest.raises(UnknownVersion):
        f.client.get_sources(2, "p1", HALF, offer=offer("p1", HALF))
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(f.client.get_sources, 2, "p1", HALF, offer=offer("p1", HALF), wait_s=30)
        time.sleep(0.3)
        assert not asked.done(), "answered before version 2 was readable"
        f.publish(2)
        sources = asked.result(timeout=10)
    assert sources.version == 2 and _primaries(sources) == {"rank-0"}
    # A version that never comes: UnknownVersion once the wait is over, and nothing assigned.
    with pytest.raises(UnknownVersion):
        f.client.get_sources(3, "p2", HALF, wait_s=0.2)
    assert "p2" not in f.nodes(2)


def test_calls_parked_for_a_version_are_answered_together_parents_first(fleet):
    """Receivers that asked (with their leases) before the version was readable are answered
    in one pass once it is: a chain parked children first is assigned parents first. A call
    held for a parent that is not parked goes on alone and is answered when the parent asks."""
    f = fleet(
        *("--max-root-children", "1", "--max-children", "1", "--hold-parents-seconds", "20"),
        *("--log-level", "DEBUG"),
    )
    chain = ("p1", "p2", "p3")
    for rid in chain:
        f.client.get_sources(1, rid, HALF, offer=offer(rid, HALF))
    for rid in chain:
        f.client.release_sources(1, rid, complete=True)

    def park(rid: str, version: int) -> Pending[Answer]:
        request = get_sources_request(version, rid, HALF, offer=offer(rid, HALF), wait_s=30)
        request.lease_ttl_seconds, request.lease_with_checksums = 30.0, True
        return f.client.ask_later(request)

    asked = {rid: park(rid, 2) for rid in reversed(chain)}
    time.sleep(0.3)
    assert not any(a.done() for a in asked.values()), "answered before version 2 was readable"
    published = time.monotonic()
    f.publish(2)
    answers = {rid: a.result(timeout=10) for rid, a in asked.items()}
    assert time.monotonic() - published < 5  # not after the 20 s hold
    parents = {rid: _primaries(a.sources()) for rid, a in answers.items()}
    assert parents == {"p1": {"rank-0"}, "p2": {"p1"}, "p3": {"p2"}}
    for rid, answer in answers.items():
        lease = lease_from_proto(answer.reply.lease)
        assert (lease.version, lease.receiver_id) == (2, rid) and lease.checksums
        f.client.release_lease(lease)
    assert "version 2: parked calls answered together, in order: ['p1', 'p2', 'p3']" in f.log()
    for rid in chain:
        f.client.release_sources(2, rid, complete=True)

    # p1 does not park for version 3: p2, held for it, and p3, held for p2, go on alone and
    # are answered once p1 asks.
    asked = {rid: park(rid, 3) for rid in ("p3", "p2")}
    f.publish(3)
    time.sleep(0.3)
    assert not any(a.done() for a in asked.values()), "answered before the held parent asked"
    first = f.client.get_sources(3, "p1", HALF, offer=offer("p1", HALF))
    answers = {rid: a.result(timeout=10) for rid, a in asked.items()}
    assert _primaries(first) == {"rank-0"}
    assert {rid: _primaries(a.sources()) for rid, a in answers.items()} == {
        "p2": {"p1"},
        "p3": {"p2"},
    }
    alone = "version 3: parked calls answered together, in order: []; going on alone: ['p3', 'p2']"
    assert alone in f.log()

    # A parked call refused once the version is readable gets its own error, and the calls
    # beside it their answers: a want of no parameter, and one held only by a full source.
    for rid in ("p2", "p3"):
        f.client.release_sources(3, rid, complete=True)
    f.client.release_sources(3, "p1", complete=True)
    bad = get_sources_request(4, "bad", [Want("nope", Box.full((4,)))], wait_s=30)
    bad.lease_ttl_seconds = 30.0
    asked = {"bad": f.client.ask_later(bad), "p1": park("p1", 4)}
    f.publish(4)
    with pytest.raises(InvalidRequest, match="is not a parameter"):
        asked["bad"].result(timeout=10)
    assert _primaries(asked["p1"].result(timeout=10).sources()) == {"rank-0"}
    assert "bad" not in f.nodes(4)


def test_sources_and_a_lease_come_in_one_call_and_a_refused_call_holds_no_lease(fleet):
    f = fleet("--when-all-slots-leased", "fail")
    request = get_sources_request(1, "p1", HALF, offer=offer("p1", HALF))
    request.lease_ttl_seconds, request.lease_with_checksums = 30.0, True
    answer = f.client.ask(request)
    assert _primaries(answer.sources()) == {"rank-0"}
    lease = lease_from_proto(answer.reply.lease)
    alone = f.client.acquire_lease(1, "someone", 30.0, checksums=True)
    assert (lease.version, lease.receiver_id, lease.manifest_key) == (1, "p1", alone.manifest_key)
    assert lease.checksums == alone.checksums and lease.checksums
    assert 0 < lease.expires_in_seconds <= 30.0
    # A lease like AcquireLease's: its holder renews and ends it.
    f.client.renew_lease(lease, 30.0)
    for held in (lease, alone):
        f.client.release_lease(held)

    # Refused (nobody holds the wanted box): no lease stays behind, so with version 2 leased
    # (a fully leased trainer fails its step here), version 3 still retires version 1.
    gap = pb.GetSourcesRequest(
        version=1,
        receiver_id="g",
        wants=[pb.WantedBox(name="gap", box=pb.Box(start=[2], stop=[4]))],
        lease_ttl_seconds=30.0,
    )
    assert _code(f.stub.GetSources, gap) == grpc.StatusCode.UNAVAILABLE
    f.publish(2)
    second = f.client.acquire_lease(2, "someone", 30.0)
    f.publish(3)
    f.client.release_lease(second)
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    for ttl in (-1.0, float("nan"), 1e9):
        assert _code(f.stub.GetSources, request, version=3, lease_ttl_seconds=ttl) == invalid


def _raw_offer(receiver: str, wants: list[Want]) -> pb.PeerOffer:
    o = offer(receiver, wants)
    return pb.PeerOffer(
        agent=pb.SourceAgent(name=receiver, metadata=b"m"),
        locations=[location_to_proto(loc) for loc in o.locations],
        progress=location_to_proto(o.progress),
    )


def _code(call, request, **changes) -> grpc.StatusCode:
    for name, value in changes.items():
        setattr(request, name, value)
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=30)
    assert info.value.details()
    return info.value.code()


def test_errors_map_to_status_codes_and_client_exceptions(fleet):
    f = fleet("--max-root-children", "1")
    c = f.client
    with pytest.raises(UnknownVersion, match="version 9"):
        c.get_sources(9, "r", HALF)
    with pytest.raises(UnknownVersion):
        c.list_tree(9)
    with pytest.raises(UnknownVersion):
        c.release_sources(9, "r", complete=True)
    with pytest.raises(NoLiveSource, match="gap"):
        c.get_sources(1, "r", [Want("gap", Box(((2, 4),)))])
    c.get_sources(1, "r1", HALF[:1])
    with pytest.raises(NoSourceFree, match="maximum of children"):
        c.get_sources(1, "r2", HALF[:1])

    bad_offers = {
        "offer.agent.name": Offer(
            offer("x", HALF).agent, offer("r", HALF).locations, offer("r", HALF).progress
        ),
        "offer.locations": offer("r", HALF[:2]),
    }
    for field, bad in bad_offers.items():
        with pytest.raises(InvalidRequest) as refused:
            c.get_sources(1, "r", HALF, offer=bad)
        assert refused.value.field == field
    shapes = offer("r", [Want("w", Box(((0, 2), (0, 8)))), *HALF[1:]])
    with pytest.raises(InvalidRequest, match="not the shape"):
        c.get_sources(1, "r", HALF, offer=shapes)
    with pytest.raises(InvalidRequest, match="is not a parameter"):
        c.get_sources(1, "r", [Want("nope", Box.full((4,)))])
    with pytest.raises(InvalidRequest, match="outside shape"):
        c.get_sources(1, "r", [Want("norm", Box.full((5,)))])
    with pytest.raises(InvalidRequest, match="receiver_id"):
        c.get_sources(1, "", HALF)

    stub = f.stub
    wants = [pb.WantedBox(name=w.name, box=box_to_proto(w.box)) for w in HALF]

    def request(**changes) -> pb.GetSourcesRequest:
        o = _raw_offer("r", HALF)
        for name, value in changes.items():
            if value is None:
                o.ClearField(name)
        message = pb.GetSourcesRequest(version=1, receiver_id="r", wants=wants, offer=o)
        return message

    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert _code(stub.GetSources, request(progress=None)) == invalid
    small = request()
    small.offer.progress.nbytes = 16
    small.offer.progress.shape[:] = [16]
    small.offer.progress.strides[:] = [1]
    assert _code(stub.GetSources, small) == invalid
    nbytes = request()  # f32 box of 4 x 4: 64 bytes, not 32 (a 2-byte dtype's)
    nbytes.offer.locations[0].nbytes = 32
    assert _code(stub.GetSources, nbytes) == invalid
    foreign = request()
    foreign.offer.locations[0].agent = "someone-else"
    assert _code(stub.GetSources, foreign) == invalid
    no_meta = request()
    no_meta.offer.agent.metadata = b""
    assert _code(stub.GetSources, no_meta) == invalid
    # A progress file must be named as one, at an absolute path, with its host.
    for host, path in (
        ("h", "/etc/passwd"),
        ("h", "relative/trainer-refit-progress.1.1.0123456789abcdef"),
        ("", "/dev/shm/trainer-refit-progress.1.1.0123456789abcdef"),
    ):
        mirrored = request()
        mirrored.offer.progress_file.host = host
        mirrored.offer.progress_file.path = path
        assert _code(stub.GetSources, mirrored) == invalid, path
    assert _code(stub.GetSources, pb.GetSourcesRequest(version=1, receiver_id="r")) == invalid
    for wait in (-1.0, float("nan"), 1e9):
        assert _code(stub.GetSources, request(), wait_seconds=wait) == invalid
    not_found = grpc.StatusCode.NOT_FOUND
    assert _code(stub.ListTree, pb.ListTreeRequest(version=7)) == not_found
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _code(stub.GetSources, request()) == exhausted
    gap = pb.GetSourcesRequest(
        version=1,
        receiver_id="g",
        wants=[pb.WantedBox(name="gap", box=pb.Box(start=[2], stop=[4]))],
    )
    assert _code(stub.GetSources, gap) == grpc.StatusCode.UNAVAILABLE
    # A refused request changed nothing: r is nowhere in the tree.
    assert set(f.nodes()) == {"rank-0", "rank-1", "r1"}


def test_a_new_trainer_generation_starts_a_fresh_tree(fleet):
    f = fleet("--log-level", "DEBUG")
    f.client.get_sources(1, "p1", HALF, offer=offer("p1", HALF))
    assert "p1" in f.nodes()
    f.register()
    with pytest.raises(UnknownVersion):
        f.client.list_tree(1)
    f.publish(1)
    assert set(f.nodes()) == set(RANKS)
    assert _primaries(f.client.get_sources(1, "r", HALF)) == {"rank-0"}
    f.client.release_sources(1, "r", complete=True)
    # At DEBUG, the tree after each GetSources and ReleaseSources.
    log = f.log()
    assert "version 1: 3 nodes, depth 1\n" in log and "r [receiver, filling" in log
    assert "r [receiver, complete, domain '', 0 children] <- ['rank-0 (done)']" in log


def test_only_receivers_may_call_the_tree_rpcs(fleet):
    f = fleet()
    trainer = f.sidecar.stub(Role.TRAINER)
    for call, request in [
        (trainer.GetSources, pb.GetSourcesRequest(version=1, receiver_id="r")),
        (trainer.ReleaseSources, pb.ReleaseSourcesRequest(version=1, receiver_id="r")),
        (trainer.ListTree, pb.ListTreeRequest(version=1)),
    ]:
        assert _code(call, request) == grpc.StatusCode.PERMISSION_DENIED
    assert set(f.nodes()) == set(RANKS)


def test_the_tree_flags_reach_the_config():
    config, _ = parse_config(["--insecure"])
    assert config.tree == TreeConfig() and config.drain_timeout_s == 5.0
    config, _ = parse_config(
        [
            "--insecure",
            "--max-children",
            "1",
            "--max-root-children",
            "3",
            "--peer-ttl-seconds",
            "7.5",
            "--drain-timeout-seconds",
            "0.25",
        ]
    )
    assert config.tree == TreeConfig(max_children=1, max_root_children=3, peer_ttl_s=7.5)
    assert config.drain_timeout_s == 0.25
    for bad in (["--max-children", "0"], ["--drain-timeout-seconds", "-1"]):
        with pytest.raises(SystemExit):
            parse_config(["--insecure", *bad])
