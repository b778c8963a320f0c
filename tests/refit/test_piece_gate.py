"""Reading behind a snapshot copy in pieces: the pieces' layout, their words on the wire, and a
real NIXL pull (two agents in this process, the slot in host memory) whose requests wait for
the pieces this test copies and names by hand."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import pytest

from refit_sidecar.core.manifest import (
    VERSION_WORD_BYTES,
    AgentRecord,
    Box,
    DType,
    Manifest,
    ParameterRecord,
    ShardLocation,
    ShardPiece,
    ShardRecord,
    SnapshotPieces,
)
from refit_sidecar.core.plan import PullPlan, Want, plan_pull
from refit_sidecar.memory.region import Region
from refit_sidecar.publish.slot_layout import Region as Copy
from refit_sidecar.publish.slot_layout import cut_into_pieces, piece_ends
from refit_sidecar.pull.nixl_transport import NixlConfig, NixlTransport
from refit_sidecar.pull.piece_gate import PieceGate
from refit_sidecar.pull.trace import PullTrace
from refit_sidecar.pull.transport import PullStats, SourceLost
from refit_sidecar.pull.version_words import VersionWords, WordTimeout
from refit_sidecar.service.wire import agent_from_proto, agent_to_proto

# -- the pieces' layout -------------------------------------------------------------------------


def test_pieces_double_from_the_first_and_end_at_the_slot() -> None:
    assert piece_ends(100, 10) == (10, 30, 70, 100)
    assert piece_ends(70, 10) == (10, 30, 70)
    assert piece_ends(100, 0) == (100,)  # one piece: the whole copy, then its word
    assert piece_ends(100, 100) == piece_ends(100, 500) == (100,)
    six_gb = piece_ends(6 << 30, 32 << 20)
    assert len(six_gb) == 8 and six_gb[0] == 32 << 20 and six_gb[-1] == 6 << 30
    with pytest.raises(ValueError, match="bad slot size"):
        piece_ends(0, 10)


def test_copies_cut_at_the_pieces_keep_every_byte_once_in_slot_order() -> None:
    regions = [Copy(storage=1, start=0, stop=50, offset=0), Copy(2, 100, 125, 64)]
    ends = piece_ends(96, 16)  # 16, 48, 96
    pieces = cut_into_pieces(regions, ends)
    assert pieces == [
        [Copy(1, 0, 16, 0)],
        [Copy(1, 16, 48, 16)],
        [Copy(1, 48, 50, 48), Copy(2, 100, 125, 64)],
    ]
    with pytest.raises(ValueError, match="past the slot's last piece"):
        cut_into_pieces(regions, (16, 48))


def _location(address: int, nbytes: int) -> ShardLocation:
    return ShardLocation.contiguous(agent="rank0", address=address, shape=(nbytes,), itemsize=1)


def test_the_last_piece_word_is_the_version_word_and_survives_the_wire() -> None:
    pieces = SnapshotPieces(_location(4096, 3 * VERSION_WORD_BYTES), 1 << 20, (16, 48, 96))
    word = _location(pieces.last_word, VERSION_WORD_BYTES)
    agent = AgentRecord("rank0", metadata=b"m", version_word=word, pieces=pieces)
    assert agent_from_proto(agent_to_proto(agent)) == agent
    assert [pieces.piece_of((1 << 20) + end) for end in (1, 16, 17, 48, 96)] == [0, 0, 1, 1, 2]
    with pytest.raises(ValueError, match="outside the slot"):
        pieces.piece_of((1 << 20) + 97)
    with pytest.raises(ValueError, match="last word must be its version word"):
        AgentRecord("rank0", metadata=b"m", version_word=_location(4096, 8), pieces=pieces)
    with pytest.raises(ValueError, match="last word must be its version word"):
        AgentRecord("rank0", metadata=b"m", pieces=pieces)
    with pytest.raises(ValueError, match="increasing"):
        SnapshotPieces(_location(4096, 16), 0, (48, 16))
    with pytest.raises(ValueError, match="bytes of words"):
        SnapshotPieces(_location(4096, 16), 0, (16, 48, 96))


# -- a pull behind a copy driven by hand --------------------------------------------------------

ROWS, COLS = 128, 64  # float32: 32 KiB per tensor, four tensors in a 128 KiB slot
NAMES = ("a", "b", "c", "d")
ENDS = piece_ends(len(NAMES) * ROWS * COLS * 4, 8192)  # 8, 24, 56, 120, 128 KiB


@dataclass
class Slot:
    transport: NixlTransport
    bytes: np.ndarray
    words: np.ndarray
    manifest: Manifest

    def copy(self, version: int, truth: np.ndarray, pause_s: float) -> None:
        """Copies `truth` into the slot piece by piece, each followed by its word."""
        start = 0
        for i, end in enumerate(ENDS):
            time.sleep(pause_s)
            self.bytes[start:end] = truth[start:end]
            self.words[i] = version
            start = end


@pytest.fixture(scope="module")
def agents() -> Iterator[tuple[NixlTransport, NixlTransport]]:
    source = NixlTransport.create(NixlConfig(name="copying-rank", progress_poll_s=0.001))
    puller = NixlTransport.create(
        NixlConfig(name="behind", pull_timeout_s=30, request_bytes=4096, requests_in_flight=2)
    )
    yield source, puller
    puller.close()
    source.close()


@pytest.fixture(scope="module")
def slot(agents: tuple[NixlTransport, NixlTransport]) -> Slot:
    source, _ = agents
    nbytes = ENDS[-1]
    memory = np.zeros(nbytes, np.uint8)
    words = np.zeros(len(ENDS), np.uint64)
    source.register(Region.of_array(memory))
    source.register(Region.of_array(words))
    name = source._config.name
    words_at = ShardLocation.contiguous(
        agent=name, address=words.ctypes.data, shape=(words.nbytes,), itemsize=1
    )
    pieces = SnapshotPieces(words_at, memory.ctypes.data, ENDS)
    word = ShardLocation.contiguous(
        agent=name, address=pieces.last_word, shape=(VERSION_WORD_BYTES,), itemsize=1
    )
    agent = AgentRecord(name, metadata=source.metadata(), version_word=word, pieces=pieces)
    size = ROWS * COLS * 4
    parameters = tuple(
        ParameterRecord(
            n,
            (ROWS, COLS),
            DType.FLOAT32,
            (
                ShardRecord(
                    ShardLocation.contiguous(
                        agent=name,
                        address=memory.ctypes.data + i * size,
                        shape=(ROWS, COLS),
                        itemsize=4,
                    ),
                    (ShardPiece(Box.full((ROWS, COLS)), (0, 0)),),
                ),
            ),
        )
        for i, n in enumerate(NAMES)
    )
    return Slot(source, memory, words, Manifest(1, parameters, {name: agent}))


@pytest.fixture
def words(agents: tuple[NixlTransport, NixlTransport]) -> Iterator[VersionWords]:
    """The puller's memory for the sources' words."""
    words = VersionWords(agents[1])
    yield words
    words.release()


def _plan(slot: Slot) -> PullPlan:
    return plan_pull(slot.manifest, [Want(n, Box.full((ROWS, COLS))) for n in NAMES])


def _pull(
    puller: NixlTransport,
    words: VersionWords,
    slot: Slot,
    version: int,
    *,
    deadline_s: float,
    out: dict[str, object],
) -> tuple[threading.Thread, np.ndarray, PieceGate]:
    """Starts a pull of the slot gated on its pieces holding `version` (`deadline_s` from
    now); its stats or error go to `out`."""
    plan = _plan(slot)
    gate = PieceGate(puller, words, slot.manifest.agents, version, time.monotonic() + deadline_s)
    dest = np.zeros(plan.nbytes, np.uint8)
    out.clear()

    def go() -> None:
        try:
            out["stats"] = puller.pull(plan, Region.of_array(dest), gate=gate)
        except (SourceLost, TimeoutError) as e:
            out["error"] = e

    thread = threading.Thread(target=go)
    thread.start()
    return thread, dest, gate


def _truth(version: int) -> np.ndarray:
    return np.random.default_rng(version).integers(1, 256, ENDS[-1], dtype=np.uint8)


def _expected(plan: PullPlan, truth: np.ndarray, base: int) -> np.ndarray:
    expected = np.zeros(plan.nbytes, np.uint8)
    for reads in plan.reads:
        for remote, length, at in zip(
            reads.remote_addresses, reads.lengths, reads.dest_offsets, strict=True
        ):
            start = int(remote) - base
            expected[int(at) : int(at) + int(length)] = truth[start : start + int(length)]
    return expected


def test_requests_wait_for_their_pieces_and_read_the_version_behind_the_copy(
    agents: tuple[NixlTransport, NixlTransport], slot: Slot, words: VersionWords
) -> None:
    _, puller = agents
    for version, pause_s in ((1, 0.05), (2, 0.02)):
        out: dict[str, object] = {}
        truth = _truth(version)
        thread, dest, gate = _pull(puller, words, slot, version, deadline_s=20, out=out)
        # The copy starts once the gate has looked (a loaded machine may start the pull's
        # thread late), so its first look finds no piece.
        while gate.first_seen is None:
            time.sleep(0.001)
        # The slot holds the last version's bytes until each piece is copied: a request
        # posted before its piece's word named the version would read those.
        slot.copy(version, truth, pause_s)
        thread.join(30)
        assert "error" not in out, out
        stats = out["stats"]
        assert isinstance(stats, PullStats)
        assert np.array_equal(dest, _expected(_plan(slot), truth, slot.bytes.ctypes.data))
        assert stats.gated_s >= pause_s  # nothing was posted before the first piece
        assert gate.open and gate.rounds >= 2
        # The first look came before the copy's pause was over and found no piece.
        assert 0 < stats.gate_first_s < stats.gated_s
        assert stats.gate_first_pieces == 0 and stats.gate_rounds == gate.rounds


def test_a_newer_piece_fails_the_pull_and_missing_pieces_time_out(
    agents: tuple[NixlTransport, NixlTransport], slot: Slot, words: VersionWords
) -> None:
    _, puller = agents
    out: dict[str, object] = {}
    slot.words[:] = 5
    slot.words[0] = 7  # the slot was handed to version 7: the lease on 6 did not hold
    thread, _, _ = _pull(puller, words, slot, 6, deadline_s=20, out=out)
    thread.join(30)
    assert isinstance(out.get("error"), SourceLost), out
    assert "version 7, not 6" in str(out["error"])

    slot.words[:] = 5
    slot.words[0] = 6  # one piece of 6 landed, the rest never do
    thread, _, gate = _pull(puller, words, slot, 6, deadline_s=0.3, out=out)
    thread.join(30)
    assert isinstance(out.get("error"), WordTimeout), out
    assert "did not hold version 6 in time" in str(out["error"])
    assert gate.rounds >= 2  # read until the deadline, then once more

    # The puller reads the next version as before, even with its deadline past already
    # (a follower told of a readable version waits for nothing): the words are read once.
    truth = _truth(8)
    slot.copy(8, truth, 0.0)
    thread, dest, _ = _pull(puller, words, slot, 8, deadline_s=-1, out=out)
    thread.join(30)
    assert "error" not in out, out
    assert np.array_equal(dest, _expected(_plan(slot), truth, slot.bytes.ctypes.data))


def test_after_a_pull_the_version_words_say_whether_a_copy_began_under_it(
    slot: Slot, words: VersionWords
) -> None:
    records = list(slot.manifest.agents.values())
    slot.words[:] = 9
    assert words.still(records, 9)
    slot.words[:] = 0  # the rank started its next copy into the slot
    assert not words.still(records, 9)
    slot.words[:] = 11  # and finished it
    assert not words.still(records, 9)
    no_words = [replace(r, version_word=None, pieces=None) for r in records]
    assert not words.still(no_words, 11)  # nothing to tell by: the sidecar is asked


def _copied(
    puller: NixlTransport, words: VersionWords, slot: Slot, version: int
) -> tuple[PullPlan, np.ndarray, np.ndarray, PieceGate]:
    """The slot holding `version` whole (every piece's word set), a destination for its plan
    and a gate on that version: (plan, destination, the version's bytes, gate)."""
    plan = _plan(slot)
    truth = _truth(version)
    slot.copy(version, truth, 0.0)
    gate = PieceGate(puller, words, slot.manifest.agents, version, time.monotonic() + 20)
    return plan, np.zeros(plan.nbytes, np.uint8), truth, gate


def test_a_pull_whose_pieces_landed_posts_its_first_requests_during_its_set_up(
    agents: tuple[NixlTransport, NixlTransport], slot: Slot, words: VersionWords
) -> None:
    _, puller = agents
    plan, dest, truth, gate = _copied(puller, words, slot, 12)
    trace = PullTrace()
    pending = puller.start(plan, Region.of_array(dest), gate, trace)
    # The first look at the words, checked back to back, let the requests go at once.
    assert pending.gated_s > 0 and gate.open
    stats = pending.wait()
    # The timeline: set up, looked (every piece there), then each request posted and landed.
    events = [(name, value) for _, name, _, value in stats.trace]
    requests = len(pending.xfers)
    assert events[:3] == [("began", 0), ("prepared", requests), ("saw", len(ENDS))]
    assert sorted(events[3:]) == sorted(
        [("landed", x.nbytes) for x in pending.xfers]
        + [("posted", x.nbytes) for x in pending.xfers]
    )
    assert stats.trace == tuple(sorted(trace.events))
    assert np.array_equal(dest, _expected(plan, truth, slot.bytes.ctypes.data))
    # Every piece held the version at the first look, before the first request went.
    assert stats.gate_first_pieces == len(ENDS) and stats.gate_rounds == 1
    assert 0 < stats.gate_first_s <= stats.gated_s


def test_a_look_posted_before_the_pull_is_the_one_it_takes(
    agents: tuple[NixlTransport, NixlTransport], slot: Slot, words: VersionWords
) -> None:
    """What `BeforeReadable.start` does: the gate's first look goes out when the early pull
    is planned, and the pull's set-up takes it instead of posting its own."""
    _, puller = agents
    plan, dest, truth, gate = _copied(puller, words, slot, 13)
    gate.poll(slot.manifest.agents)  # in flight, not taken yet
    assert gate.rounds == 0 and gate.first_seen is None
    stats = puller.start(plan, Region.of_array(dest), gate).wait()
    assert np.array_equal(dest, _expected(plan, truth, slot.bytes.ctypes.data))
    assert gate.open and stats.gate_rounds == 1 and stats.gate_first_pieces == len(ENDS)

    # A look left in flight by a pull that never started is waited for, and the next gate
    # on the same memory reads the words again.
    slot.copy(14, _truth(14), 0.0)
    gate = PieceGate(puller, words, slot.manifest.agents, 14, time.monotonic() + 20)
    gate.poll(slot.manifest.agents)
    gate.settle()
    assert gate.rounds == 0
    gate = PieceGate(puller, words, slot.manifest.agents, 14, time.monotonic() + 20)
    stats = puller.start(plan, Region.of_array(dest), gate).wait()
    assert gate.open and stats.gate_rounds == 1


def test_a_gate_opens_on_the_sidecars_word_without_looking(
    agents: tuple[NixlTransport, NixlTransport], slot: Slot, words: VersionWords
) -> None:
    """`readable`: once the sidecar has said the version is readable (every rank's copy
    landed), the gate opens without reading the words. Until then it looks as before."""
    _, puller = agents
    plan = _plan(slot)
    truth = _truth(15)
    slot.copy(15, truth, 0.0)
    said = [True]
    gate = PieceGate(
        puller, words, slot.manifest.agents, 15, time.monotonic() + 20, readable=lambda: said[0]
    )
    dest = np.zeros(plan.nbytes, np.uint8)
    gate.poll(slot.manifest.agents)  # no look posted: the answer is in
    stats = puller.start(plan, Region.of_array(dest), gate, PullTrace()).wait()
    assert gate.open and gate.told is not None and stats.gate_rounds == 0
    events = [name for _, name, _, _ in stats.trace]
    assert "readable" in events and "saw" not in events, events
    assert np.array_equal(dest, _expected(plan, truth, slot.bytes.ctypes.data))

    said[0] = False  # not answered yet: the gate looks, and opens on its look
    gate = PieceGate(
        puller, words, slot.manifest.agents, 15, time.monotonic() + 20, readable=lambda: said[0]
    )
    dest[:] = 0
    stats = puller.start(plan, Region.of_array(dest), gate).wait()
    assert gate.open and gate.told is None and stats.gate_rounds == 1
    assert np.array_equal(dest, _expected(plan, truth, slot.bytes.ctypes.data))
