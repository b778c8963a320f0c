"""The data path of pipelined fan-out, piece by piece: byte intervals, the progress word, route
manifests, and a chunked pull from a peer whose progress this test drives by hand (real NIXL:
the peer and the puller are two agents in this process, the peer's copy in host memory)."""

from __future__ import annotations

import functools
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from refit_sidecar.core.intervals import Intervals
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
from refit_sidecar.core.plan import PullPlan, Want, plan_pull
from refit_sidecar.core.tree_records import NodeKind, Route
from refit_sidecar.memory.region import Region
from refit_sidecar.memory.tensor_arena import TorchWords
from refit_sidecar.pull.chunking import chunk_bounds
from refit_sidecar.pull.filled import Filled
from refit_sidecar.pull.nixl_transport import NixlConfig, NixlTransport
from refit_sidecar.pull.peer_words import ControlSlots, PeerGate
from refit_sidecar.pull.pipelined import (
    HEARTBEAT_S,
    ChunkConfig,
    PipelinedPull,
    SourceFailed,
    _Peer,
)
from refit_sidecar.pull.progress import (
    PROGRESS_BYTES,
    CopyProgress,
    HostWords,
    OwnProgress,
    ProgressWord,
    TornRead,
    Words,
)
from refit_sidecar.pull.routing import clip, one_source, peer_bases, route_manifest
from refit_sidecar.pull.shared_word import ProgressFile, host_id
from refit_sidecar.pull.transport import SourceLost
from refit_sidecar.service.sources import Answer, SourceCopy, Sources
from refit_sidecar.service.wire import box_to_proto, location_to_proto, manifest_to_proto
from tests.support.peer import staged_manifest
from trainer_refit.v1 import refit_pb2 as pb

# -- intervals ------------------------------------------------------------------------------------


def test_intervals_match_a_set_of_bytes() -> None:
    rng = random.Random(7)
    for _ in range(200):
        ranges, truth = Intervals(), set[int]()
        for _ in range(12):
            a, b = sorted(rng.sample(range(64), 2))
            if rng.random() < 0.6:
                ranges.add(a, b)
                truth |= set(range(a, b))
            else:
                ranges.remove(a, b)
                truth -= set(range(a, b))
            listed = list(ranges)
            assert {i for s, e in listed for i in range(s, e)} == truth
            # Disjoint and not touching: merged.
            assert all(e1 < s2 for (_, e1), (s2, _) in itertools.pairwise(listed))
            prefix = 0
            while prefix in truth:
                prefix += 1
            assert ranges.prefix() == prefix
            a, b = sorted(rng.sample(range(65), 2))
            assert ranges.covers(a, b) == set(range(a, b)).issubset(truth)


def test_bytes_read_again_count_for_the_source_that_delivered_them_last() -> None:
    """A run after a fallback reads again the chunks an earlier run filled only in part: the
    sources' bytes still add up to the buffer, and dropping the first source (its copy
    failed) keeps what the second delivered over it."""
    plan = SimpleNamespace(nbytes=100, targets=(SimpleNamespace(offset=0, nbytes=100),))
    filled = Filled(plan)  # type: ignore[arg-type]
    filled.add("victim", np.array([[0, 40], [40, 20]]))
    filled.add("trainer", np.array([[40, 60]]))  # the chunk from 40 again, and the rest
    assert filled.bytes_by_source() == {"victim": 40, "trainer": 60}
    assert filled.complete
    filled.drop("victim")
    assert filled.bytes_by_source() == {"trainer": 60} and filled.prefix() == 0
    assert filled.valid.covers(40, 100)


# -- the progress word ----------------------------------------------------------------------------


def test_progress_word_round_trip_and_torn_reads() -> None:
    own = OwnProgress("p")
    own.start(5)
    assert own.read() == ProgressWord(5, 0, CopyProgress.FILLING)
    own.filled(4096)
    own.finish(CopyProgress.COMPLETE)
    assert own.read() == ProgressWord(5, 4096, CopyProgress.COMPLETE)
    five = own._words.copy()
    own.start(6)
    assert own.read() == ProgressWord(6, 0, CopyProgress.FILLING)
    # A read that mixes words of two versions is torn, whichever words it mixes.
    for mixed in ([five[0], own._words[1], own._words[2]], [own._words[0], five[1], five[2]]):
        with pytest.raises(TornRead):
            ProgressWord.decode(np.array(mixed, dtype="<u8"))
    with pytest.raises(TornRead, match="unknown copy state"):
        ProgressWord.decode(np.array([6, own._words[1], own._words[2] | 7], dtype="<u8"))
    assert own.location.nbytes == 24 and own.location.address == own.region.address


def test_starting_a_version_changes_the_version_word_last() -> None:
    """A reader that sees the new version also sees its reset fill: `start` writes the version
    word after the others, so a torn read shows the old version, never old fill + new version."""
    own = OwnProgress("p")
    own.start(1)
    own.filled(1 << 20)
    writes: list[int] = []

    class Recorder:
        def __init__(self, words: np.ndarray) -> None:
            self.words = words

        def __setitem__(self, index: int, value: int) -> None:
            writes.append(index)
            self.words[index] = value

    own._words = Recorder(own._words)  # type: ignore[assignment]
    own.start(2)
    assert writes == [1, 2, 0]


def test_a_word_in_device_memory_is_started_in_one_ordered_write() -> None:
    """Words stored through a copy (device memory) are handed over in one `write_words` call,
    version word last, which stores them in order with one wait for all."""
    calls: list[list[tuple[int, int]]] = []

    class Recording(TorchWords):
        def write_words(self, words: Sequence[tuple[int, int]], *, wait: bool = True) -> None:
            calls.append(list(words))
            super().write_words(words, wait=wait)

    own = OwnProgress("p", Recording(PROGRESS_BYTES, device=torch.device("cpu")))
    own.start(3)
    own.filled(512)
    assert [[offset for offset, _ in call] for call in calls] == [[8, 16, 0], [8]]
    assert calls[0][2] == (0, 3)
    assert own.read() == ProgressWord(3, 512, CopyProgress.FILLING)


def test_a_start_queued_ahead_of_the_pull_lands_when_the_pull_flushes_it() -> None:
    """A tree receiver starts its copy's word as soon as its lease is in, without waiting
    for the copy (`TreePull.ahead_lease`); the pull waits for it before its first read."""
    calls: list[tuple[list[tuple[int, int]], bool]] = []

    class Recording(TorchWords):
        def write_words(self, words: Sequence[tuple[int, int]], *, wait: bool = True) -> None:
            calls.append((list(words), wait))
            super().write_words(words, wait=wait)

    own = OwnProgress("p", Recording(PROGRESS_BYTES, device=torch.device("cpu")))
    own.start(4, wait=False)
    assert calls == [([(8, 4 << 40), (16, (4 << 40) | CopyProgress.FILLING), (0, 4)], False)]
    own.flush()
    assert calls[1] == ([], True)  # nothing stored: waits for what was queued
    assert own.read() == ProgressWord(4, 0, CopyProgress.FILLING)


# -- route manifests ------------------------------------------------------------------------------

NAME = "w"
SHAPE = (8, 6)


def _shard(agent: str, rows: tuple[int, int], crc: int | None = 7) -> ShardRecord:
    shape = (rows[1] - rows[0], SHAPE[1])
    location = ShardLocation.contiguous(agent=agent, address=4096, shape=shape, itemsize=4)
    return ShardRecord(location, (ShardPiece(Box(((rows[0], rows[1]), (0, 6))), (0, 0)),), crc)


def _copy(source: str, kind: NodeKind, *shards: ShardRecord) -> SourceCopy:
    record = ParameterRecord(NAME, SHAPE, DType.FLOAT32, shards)
    agent = AgentRecord(source, metadata=b"m")
    return SourceCopy(source, kind, Manifest(1, (record,), {source: agent}), None)


def test_clip_keeps_a_checksum_only_for_a_whole_shard() -> None:
    shard = _shard("t0", (0, 4))
    assert clip(shard, Box(((0, 8), (0, 6)))) == shard
    part = clip(shard, Box(((2, 8), (3, 6))))
    assert part is not None and part.crc32 is None
    assert part.pieces == (ShardPiece(Box(((2, 4), (3, 6))), (2, 3)),)
    assert clip(shard, Box(((4, 8), (0, 6)))) is None


def test_route_manifest_reads_each_piece_from_its_primary_only() -> None:
    """A TP=1 want over two TP=2 trainer ranks, whose second half the tree routed to a peer:
    the plan reads rows 0-4 from rank 0 and rows 4-8 from the peer, never from rank 1."""
    copies = {
        "t0": _copy("t0", NodeKind.TRAINER, _shard("t0", (0, 4))),
        "t1": _copy("t1", NodeKind.TRAINER, _shard("t1", (4, 8))),
        "peer": _copy("peer", NodeKind.PEER, _shard("peer", (0, 8), crc=None)),
    }
    routes = (
        Route(NAME, Box(((0, 4), (0, 6))), "t0", ("t1",)),
        Route(NAME, Box(((4, 8), (0, 6))), "peer", ("t1",)),
    )
    manifest = route_manifest(Sources(1, routes, copies, 30.0))
    plan = plan_pull(manifest, [Want(NAME, Box.full(SHAPE))])
    read = {(r.location.agent, int(r.shard_offsets[0]), r.nbytes) for r in plan.reads}
    assert read == {("t0", 0, 4 * 6 * 4), ("peer", 4 * 6 * 4, 4 * 6 * 4)}
    assert set(manifest.agents) == {"t0", "peer"}
    with pytest.raises(ValueError, match="not sent"):
        route_manifest(Sources(1, (Route(NAME, Box.full(SHAPE), "gone", ()),), copies, 30.0))


def _reads(plan: PullPlan) -> list[tuple[str, int, int, int]]:
    return sorted(
        (r.location.agent, int(a), int(n), int(d))
        for r in plan.reads
        for a, n, d in zip(r.remote_addresses, r.lengths, r.dest_offsets, strict=True)
    )


def test_one_source_answers_are_routed_without_planning_exactly_as_planned() -> None:
    """A receiver reading everything from one trainer rank replays its own plan; from one
    peer holding each box whole (here laid out in another order) it reads each box from
    where the peer holds it: the same reads and gate as planning from the answer."""
    shapes = {"a": (4, 8), "b": (16,), "c": (2, 3, 4)}
    wants = [Want(n, Box.full(shape)) for n, shape in shapes.items()]
    trainer = Manifest(
        3,
        tuple(
            ParameterRecord(
                n,
                shape,
                DType.FLOAT32,
                (
                    ShardRecord(
                        ShardLocation.contiguous(
                            agent="t", address=(1 << 20) * (i + 1), shape=shape, itemsize=4
                        ),
                        (ShardPiece(Box.full(shape), (0,) * len(shape)),),
                        11,
                    ),
                ),
            )
            for i, (n, shape) in enumerate(shapes.items())
        ),
        {"t": AgentRecord("t", metadata=b"m")},
    )
    plan = plan_pull(trainer, wants)
    peer_plan = plan_pull(trainer, wants[::-1])
    peer = staged_manifest(
        peer_plan, shapes, agent=AgentRecord("peer", metadata=b"pm"), address=1 << 30
    )
    progress = ShardLocation.contiguous(agent="peer", address=1 << 31, shape=(24,), itemsize=1)

    def answer(primary: str) -> Answer:
        copy = pb.SourceCopy(
            source_id=primary,
            kind=pb.SOURCE_KIND_PEER if primary == "peer" else pb.SOURCE_KIND_TRAINER,
            shards=manifest_to_proto(peer if primary == "peer" else trainer),
        )
        if primary == "peer":
            copy.progress.CopyFrom(location_to_proto(progress))
        routes = [
            pb.SourceRoute(name=w.name, box=box_to_proto(w.box), primary=primary) for w in wants
        ]
        return Answer.of(pb.GetSourcesResponse(version=3, routes=routes, sources=[copy]))

    fast = one_source(answer("peer"), plan)
    assert fast is not None
    sources = answer("peer").sources()
    planned = plan_pull(route_manifest(sources), wants)
    assert _reads(fast[0]) == _reads(planned) and fast[0].nbytes == plan.nbytes
    assert fast[1] == {"peer": PeerGate(progress, peer_bases(sources)["peer"])}
    assert list(fast[0].agents) == ["peer"] and fast[0].targets == plan.targets

    replayed = one_source(answer("t"), plan)
    assert replayed is not None and replayed[0].reads is plan.reads and replayed[1] == {}
    # Two primaries: planned from the answer instead.
    mixed = answer("peer")
    mixed.reply.routes[0].primary = "t"
    assert one_source(Answer.of(mixed.reply), plan) is None


# -- a chunked pull gated on a peer driven by hand ------------------------------------------------

ROWS, COLS = 256, 64  # float32: 64 KiB per want, 16 chunks of 4 KiB each
WANTS = [Want("a", Box.full((ROWS, COLS))), Want("b", Box.full((ROWS, COLS)))]


@dataclass
class Peer:
    transport: NixlTransport
    staging: np.ndarray
    own: OwnProgress
    plan: PullPlan
    manifest: Manifest
    truth: np.ndarray

    def fill(self, nbytes: int) -> None:
        self.staging[:nbytes] = self.truth[:nbytes]
        self.own.filled(nbytes)


@pytest.fixture(scope="module")
def agents() -> Iterator[tuple[NixlTransport, NixlTransport]]:
    peer = NixlTransport.create(NixlConfig(name="hand-peer", progress_poll_s=0.001))
    child = NixlTransport.create(NixlConfig(name="hand-child", pull_timeout_s=30))
    yield peer, child
    child.close()
    peer.close()


def _peer(
    transport: NixlTransport,
    version: int,
    words: Callable[[int], Words] = HostWords,
    mirror: ProgressFile | None = None,
) -> Peer:
    records = tuple(ParameterRecord(w.name, (ROWS, COLS), DType.FLOAT32, ()) for w in WANTS)
    # The planner needs a source for the layout only: the peer's staging is laid out as its plan.
    layout = Manifest(
        version,
        tuple(
            ParameterRecord(
                r.name,
                r.shape,
                r.dtype,
                (
                    ShardRecord(
                        ShardLocation.contiguous(
                            agent="x", address=1 << 20, shape=r.shape, itemsize=4
                        ),
                        (ShardPiece(Box.full(r.shape), (0, 0)),),
                    ),
                ),
            )
            for r in records
        ),
        {"x": AgentRecord("x", metadata=b"m")},
    )
    plan = plan_pull(layout, WANTS)
    staging = np.zeros(plan.nbytes, np.uint8)
    transport.register(Region.of_array(staging))
    own = OwnProgress(transport._config.name, words(24), mirror=mirror)
    transport.register(own.region)
    own.start(version)
    agent = AgentRecord(transport._config.name, metadata=transport.metadata())
    shapes = {w.name: (ROWS, COLS) for w in WANTS}
    manifest = staged_manifest(plan, shapes, agent=agent, address=staging.ctypes.data)
    truth = np.random.default_rng(version).integers(0, 256, plan.nbytes, dtype=np.uint8)
    return Peer(transport, staging, own, plan, manifest, truth)


def _run(
    child: NixlTransport,
    peer: Peer,
    stall_s: float = 5.0,
    words: Callable[[int], Words] = HostWords,
    *,
    verified_here: bool = False,
    listener_s: float = 0.0,
    chunks: ChunkConfig | None = None,
    follow_file: bool = False,
) -> tuple[threading.Thread, dict[str, object], np.ndarray, list[int]]:
    plan = plan_pull(peer.manifest, WANTS)
    dest = np.zeros(plan.nbytes, np.uint8)
    region = Region.of_array(dest)
    child.register(region)
    seen: list[int] = []

    def listener(filled: int, total: int) -> None:
        seen.append(filled)
        time.sleep(listener_s)

    runner = PipelinedPull(
        child,
        ControlSlots(child, words),
        chunks or ChunkConfig(chunk_bytes=4096, window=2, stall_timeout_s=stall_s),
        on_progress=listener,
        verified_here=verified_here,
    )
    mirror = peer.own.mirror
    gate = PeerGate(
        peer.own.location,
        peer.staging.ctypes.data,
        mirror.ref if follow_file and mirror is not None else None,
    )
    out: dict[str, object] = {}
    filled = Filled(plan)
    out["filled"] = filled

    def go() -> None:
        try:
            out["stats"] = runner.run(
                plan, region, filled, peers={"hand-peer": gate}, deadline=time.monotonic() + 30
            )
        except SourceLost as e:
            out["error"] = e

    thread = threading.Thread(target=go)
    thread.start()
    return thread, out, dest, seen


WORDS: dict[str, Callable[[int], Words]] = {
    "numpy": HostWords,
    # The receiver's kind (on a GPU, its device memory), here on the CPU.
    "tensor": functools.partial(TorchWords, device=torch.device("cpu")),
}


@pytest.mark.parametrize("words", sorted(WORDS))
def test_a_child_reads_only_what_its_parent_holds_and_ends_when_it_is_complete(
    agents: tuple[NixlTransport, NixlTransport], words: str
) -> None:
    peer_t, child = agents
    peer = _peer(peer_t, version=3 if words == "numpy" else 4, words=WORDS[words])
    thread, out, dest, seen = _run(child, peer, words=WORDS[words])
    for step in range(1, 9):
        peer.fill(step * peer.plan.nbytes // 8)
        time.sleep(0.05)
        # Never ahead of the parent; behind it by at most what is in flight or unvalidated.
        assert max(seen, default=0) <= step * peer.plan.nbytes // 8
    assert thread.is_alive(), "the pull ended before its parent's copy was complete"
    peer.own.finish(CopyProgress.COMPLETE)
    thread.join(10)
    assert not thread.is_alive() and "error" not in out
    assert dest.tobytes() == peer.truth.tobytes()
    assert seen[-1] == peer.plan.nbytes and seen == sorted(seen)
    stats = out["stats"]
    assert stats.bytes_by_source == {"hand-peer": peer.plan.nbytes}  # type: ignore[attr-defined]
    assert stats.chunks == 32  # type: ignore[attr-defined]
    # The parent's copy took 0.4 s to fill; the child spent most of it waiting, not reading.
    assert stats.gated_s > 0.2  # type: ignore[attr-defined]
    assert 0 < stats.reading_s < stats.gated_s  # type: ignore[attr-defined]
    # A fresh parent buffer: every chunk's request was prepared for this pull.
    assert stats.prepared == stats.chunks  # type: ignore[attr-defined]


def test_a_child_that_checks_every_byte_itself_ends_before_its_parent_is_complete(
    agents: tuple[NixlTransport, NixlTransport],
) -> None:
    """A receiver that verifies its whole copy against the trainer's checksums does not wait
    for its parent's verification: the pull ends once every chunk landed, the parent still
    FILLING. (Its own check then decides: tests/inference/test_fanout.py.)"""
    peer_t, child = agents
    peer = _peer(peer_t, version=6)
    thread, out, dest, seen = _run(child, peer, verified_here=True)
    peer.fill(peer.plan.nbytes)
    thread.join(10)
    assert not thread.is_alive() and "error" not in out, out.get("error")
    assert peer.own.read().state is CopyProgress.FILLING
    assert dest.tobytes() == peer.truth.tobytes()
    assert seen[-1] == peer.plan.nbytes
    # A parent that fails while the child still waits on it is lost, as with the default.
    peer = _peer(peer_t, version=7)
    thread, out, _, _ = _run(child, peer, verified_here=True)
    peer.fill(peer.plan.nbytes // 2)
    time.sleep(0.05)
    peer.own.finish(CopyProgress.FAILED)
    thread.join(10)
    assert not thread.is_alive()
    error = out.get("error")
    assert isinstance(error, SourceLost) and error.agent == "hand-peer"


def test_a_slow_listener_holds_no_read_back_and_hears_every_prefix_before_the_run_ends(
    agents: tuple[NixlTransport, NixlTransport],
) -> None:
    """Progress is published from a thread of its own (`progress_publisher.py`): a listener
    that takes 20 ms a call (on a GPU, a running check's kernel launches, a word write behind
    the copy queue) no longer holds the next chunks back, and the run returns once it heard
    the last prefix."""
    peer_t, child = agents
    peer = _peer(peer_t, version=9)
    peer.fill(peer.plan.nbytes)
    thread, out, dest, seen = _run(child, peer, verified_here=True, listener_s=0.02)
    thread.join(20)
    assert not thread.is_alive() and "error" not in out, out.get("error")
    returned = time.time()
    stats = out["stats"]
    assert dest.tobytes() == peer.truth.tobytes()
    assert seen == sorted(seen) and seen[-1] == peer.plan.nbytes
    # More than a few prefixes, each heard for 20 ms: the reads ended long before them.
    assert len(seen) >= 4, seen
    assert stats.finished < returned - 0.02 * (len(seen) - 2), (  # type: ignore[attr-defined]
        stats.finished,  # type: ignore[attr-defined]
        returned,
        len(seen),
    )


def test_a_tapered_cut_reads_small_chunks_at_both_ends_and_every_byte_once(
    agents: tuple[NixlTransport, NixlTransport],
) -> None:
    peer_t, child = agents
    peer = _peer(peer_t, version=10)
    config = ChunkConfig(chunk_bytes=16384, window=2, taper=2)
    thread, out, dest, seen = _run(child, peer, verified_here=True, chunks=config)
    # The child's first read waits for a quarter chunk of its parent's, not a whole one.
    peer.fill(4096)
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen and seen[0] == 4096, seen
    peer.fill(peer.plan.nbytes)
    thread.join(10)
    assert not thread.is_alive() and "error" not in out, out.get("error")
    assert dest.tobytes() == peer.truth.tobytes()
    total = peer.plan.nbytes
    stats = out["stats"]
    assert stats.chunks == len(chunk_bounds(total, 16384, 2)) + 1  # type: ignore[attr-defined]
    assert stats.bytes_by_source == {"hand-peer": total}  # type: ignore[attr-defined]
    with pytest.raises(ValueError):
        ChunkConfig(chunk_bytes=8192, taper=2)  # chunks under 4096 bytes
    with pytest.raises(ValueError):
        ChunkConfig(check_part_bytes=0)


@pytest.mark.skipif(not host_id(), reason="this host has no boot id")
def test_a_child_follows_a_peer_on_its_host_through_its_file_and_reads_its_word_as_a_heartbeat(
    agents: tuple[NixlTransport, NixlTransport], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer's progress file (`progress_file.py`) is read at every turn of the loop; its word
    in registered memory only every `HEARTBEAT_S` (a dead peer's read fails at once), instead
    of after every change."""
    peer_t, child = agents
    mirror = ProgressFile.create(str(tmp_path))
    assert mirror is not None
    peer = _peer(peer_t, version=11, mirror=mirror)
    looks: list[float] = []
    post = child.post

    def counting(*args: object) -> object:
        local = args[3]
        assert isinstance(local, np.ndarray)
        if int(local[:, 1].sum()) == PROGRESS_BYTES:
            looks.append(time.monotonic())
        return post(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(child, "post", counting)
    thread, out, dest, seen = _run(child, peer, follow_file=True)
    began = time.monotonic()
    for step in range(1, 9):
        peer.fill(step * peer.plan.nbytes // 8)
        time.sleep(0.05)
        assert max(seen, default=0) <= step * peer.plan.nbytes // 8
    assert thread.is_alive(), out
    peer.own.finish(CopyProgress.COMPLETE)
    thread.join(10)
    took = time.monotonic() - began
    assert not thread.is_alive() and "error" not in out, out.get("error")
    assert dest.tobytes() == peer.truth.tobytes()
    assert seen[-1] == peer.plan.nbytes
    # Heartbeats kept going while it waited, about one per HEARTBEAT_S (a child reading the
    # word after each change, backing off to 0.5 ms, reads it some 800 times in 0.4 s).
    assert 2 <= len(looks) <= took / HEARTBEAT_S + 10, (len(looks), took)
    peer.own.close()


def test_a_peer_word_read_two_ways_keeps_the_most_either_said(
    agents: tuple[NixlTransport, NixlTransport],
) -> None:
    """The file and the word in registered memory may lag each other: a lagging fill or a
    FILLING after COMPLETE is no step back; FAILED is taken from either."""
    _, child = agents
    runner = PipelinedPull(child, ControlSlots(child), ChunkConfig())
    gate = PeerGate(OwnProgress("p").location, 0)
    peer = _Peer(gate)
    filled = Filled(plan_pull(_peer(agents[0], version=12).manifest, WANTS))

    def look(fill: int, state: CopyProgress) -> SourceLost | None:
        own = OwnProgress("p")
        own.start(12)
        own.filled(fill)
        own.finish(state)
        raw = np.frombuffer(own._words.tobytes(), np.uint8)
        return runner._observe("p", peer, 12, filled, raw=raw, seq=0)

    assert look(100, CopyProgress.FILLING) is None and peer.word is not None
    assert look(50, CopyProgress.FILLING) is None
    assert (peer.word.filled, peer.word.state) == (100, CopyProgress.FILLING)
    assert look(200, CopyProgress.COMPLETE) is None
    assert look(150, CopyProgress.FILLING) is None
    assert (peer.word.filled, peer.word.state) == (200, CopyProgress.COMPLETE)
    assert isinstance(look(10, CopyProgress.FAILED), SourceFailed)


def test_a_layout_pulled_again_reuses_its_chunks_and_a_fresh_fill(
    agents: tuple[NixlTransport, NixlTransport],
) -> None:
    """Every version of a steady tree cuts the same reads into the same chunks: the second run
    takes them from the cache (the same arrays), and each run still starts from its own
    `Filled`, whose gaps the cache must not share."""
    peer_t, child = agents
    peer = _peer(peer_t, version=8)
    plan = plan_pull(peer.manifest, WANTS)
    dest = Region.of_array(np.zeros(plan.nbytes, np.uint8))
    gate = {"hand-peer": PeerGate(peer.own.location, peer.staging.ctypes.data)}
    runner = PipelinedPull(child, ControlSlots(child), ChunkConfig(chunk_bytes=4096, window=2))
    first = runner._chunks(plan, dest, Filled(plan), gate)
    again = runner._chunks(plan, dest, Filled(plan), gate)
    assert len(first) == len(again) == 32
    assert all(a.remote is b.remote and a is not b for a, b in zip(first, again, strict=True))
    assert [c.need for c in first] == [c.need for c in again]
    other = PipelinedPull(child, ControlSlots(child), ChunkConfig(chunk_bytes=8192, window=2))
    assert len(other._chunks(plan, dest, Filled(plan), gate)) == 16
    moved = {"hand-peer": PeerGate(peer.own.location, peer.staging.ctypes.data + 4096)}
    assert [c.need for c in runner._chunks(plan, dest, Filled(plan), moved)] != [
        c.need for c in first
    ]
    # The same reads in another tuple (a plan built anew) are digested and found again; the
    # same reads into another destination are cut anew.
    rebuilt = replace(plan, reads=tuple(plan.reads))
    assert all(
        a.remote is b.remote
        for a, b in zip(first, runner._chunks(rebuilt, dest, Filled(plan), gate), strict=True)
    )
    elsewhere = Region(dest.address + 4096, dest.nbytes, owner=dest.owner)
    assert [c.local[0][0] for c in runner._chunks(plan, elsewhere, Filled(plan), gate)] != [
        c.local[0][0] for c in first
    ]
    one, two = Filled(plan), Filled(plan)
    one.add("hand-peer", np.array([[0, plan.nbytes]]))
    assert one.complete and not two.complete and two.prefix() == 0


@pytest.mark.parametrize("how", ["failed", "moved-on", "stalled"])
def test_a_parent_that_fails_moves_on_or_stalls_is_lost(
    agents: tuple[NixlTransport, NixlTransport], how: str
) -> None:
    peer_t, child = agents
    peer = _peer(peer_t, version=10)
    thread, out, _, seen = _run(child, peer, stall_s=0.5)
    half = peer.plan.nbytes // 2
    peer.fill(half)
    deadline = time.monotonic() + 10
    while max(seen, default=0) < half and time.monotonic() < deadline:
        time.sleep(0.005)  # until the child holds, validated, all the parent has
    began = time.monotonic()
    if how == "failed":
        peer.own.finish(CopyProgress.FAILED)
    elif how == "moved-on":
        peer.own.start(11)
    thread.join(5)
    assert not thread.is_alive()
    error = out.get("error")
    assert isinstance(error, SourceLost) and error.agent == "hand-peer"
    filled = out["filled"]
    assert isinstance(filled, Filled)
    if how == "failed":
        # Everything read from a failed copy is dropped.
        assert isinstance(error, SourceFailed) and not error.exposed
        assert filled.valid.total == filled.nbytes - sum(t.nbytes for t in peer.plan.targets)
    else:
        assert not isinstance(error, SourceFailed)
        # What was validated before the parent went stays.
        assert filled.prefix() == max(seen) == half
    if how == "stalled":
        assert 0.3 < time.monotonic() - began < 2.0
        assert "did not advance" in str(error)
