"""A pull in chunks, gated on each peer's progress: the data path of pipelined fan-out.

`PipelinedPull.run` reads a `PullPlan` whose sources are trainer ranks (every byte readable at
once, their slots held by the receiver's lease) and peers (receivers still filling their copy,
docs/fanout.md). Each source's reads are cut into chunks of about `chunk_bytes` (a long read
into several); a peer's chunks go in the order of its own buffer, so chunk k is read as soon as
the peer's progress word (`progress.py`) says it holds chunk k. At most `window` chunks are in
flight. A chunk read from a peer counts only once a later read of the peer's word still shows
the same version not FAILED (the peer had not started overwriting it), and the pull ends only
when every peer it read from says COMPLETE (verified). Unless the caller verifies every byte
itself against the trainer's checksums (`verified_here`): a chunk then counts as it lands
(bytes being overwritten under the read would fail that check) and the pull ends with its last
chunk, so a chain of receivers does not wait for each level above it to verify in turn.

What this receiver holds is published as it goes (`Filled`, and its own progress word when it
serves): the bytes of the destination filled in order from its first byte, counting the
alignment gaps between targets as filled, so its own children can read behind it.

A source that fails (a read error, a disconnect, a peer whose word stops advancing for
`stall_timeout_s`, or that moves on to another version or fails) ends the run with
`SourceLost(agent=...)` after the other sources' reads in flight have landed; what was valid
stays in `Filled`, so the caller asks for other sources and runs again for the rest.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from refit_sidecar.core.intervals import Intervals
from refit_sidecar.core.manifest import AgentRecord, MemType, ShardLocation
from refit_sidecar.core.plan import PullPlan
from refit_sidecar.core.shared_word_ref import ProgressFileRef
from refit_sidecar.memory.region import Region
from refit_sidecar.pull.announcer import ProgressPublisher
from refit_sidecar.pull.chunking import chunk_bounds, cut_at, merge_continuing
from refit_sidecar.pull.nixl_transport import NixlTransport, Posted
from refit_sidecar.pull.progress import (
    PROGRESS_BYTES,
    CopyProgress,
    HostWords,
    OwnProgress,
    ProgressWord,
    TornRead,
    Words,
)
from refit_sidecar.pull.running_check import DEFAULT_PART_BYTES
from refit_sidecar.pull.shared_word import ProgressFileReader
from refit_sidecar.pull.trace import PullTrace, TraceEvent
from refit_sidecar.pull.transport import SourceLost

_SLOT = 64
"""Bytes per progress-word slot in the control buffer (aligned)."""
_READERS_KEPT = 16
"""Peers' progress files kept open."""


@dataclass(frozen=True)
class PeerGate:
    """How to follow a peer's copy: its progress word, and the address of its copy's first
    byte (the fill in its word counts from there); its mirror of the word in a file, when it
    offered one (read instead of the word where the file is on this host)."""

    progress: ShardLocation
    base: int
    file: ProgressFileRef | None = None


_FOLLOW_CLOSELY_S = 0.005
"""A peer followed through its file whose copy advanced this recently is looked at every
50 µs at most; one that did not, every 0.5 ms (a stalled parent costs no busy loop)."""

_YIELD_S = 2e-5
"""A turn of the loop that made progress sleeps this long while the progress publisher has
work (`ProgressPublisher.busy`), so its lanes get the interpreter between the loop's turns."""

HEARTBEAT_S = 0.005
"""A peer followed through its progress file has its word read one-sidedly this often too:
the read fails at once when the peer died, while its file only stops changing."""


DEFAULT_CHUNK_BYTES = 256 << 20
"""Each chunk costs about 0.2 ms of its own (its gate, post and progress update), whatever its
size: on two H100s a 2 GB peer read on one GPU had reads in flight for 15-28 ms in 16 MiB
chunks, 7.6-10 ms in 64 MiB and 3.4-4.4 ms in 256 MiB ones (BENCHMARKS.md, "Rerun on two
H100s"), while a level of the tree lags its parent by about one chunk (1 ms at 256 GB/s)."""


@dataclass(frozen=True, kw_only=True)
class ChunkConfig:
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Bytes per chunk: a child reads a parent's chunk once the parent has all of it."""
    window: int = 4
    """Chunks in flight at once, over all sources."""
    trace: bool = False
    """Record each pull's timeline (`pull_trace.py`) into its stats."""
    taper: int = 0
    """Halvings of the chunk size towards each end of a source's reads (`chunking.chunk_bounds`):
    a child starts after a smaller first chunk of its parent's and ends a smaller last chunk
    after it."""
    stall_timeout_s: float = 5.0
    """A peer whose copy does not advance for this long, while this pull waits on it, is
    treated as lost."""
    check_part_bytes: int = DEFAULT_PART_BYTES
    """Bytes per part of the running check (`running_check.RunningCheck`): a part's sums
    start once the pull's prefix holds all of it; the last part is summed after the pull."""

    def __post_init__(self) -> None:
        if (
            self.check_part_bytes < 1
            or self.chunk_bytes < 4096
            or self.window < 1
            or not self.stall_timeout_s > 0
            or not 0 <= self.taper <= 8
            or self.chunk_bytes >> self.taper < 4096
        ):
            raise ValueError(f"bad chunk config {self}")


class SourceFailed(SourceLost):
    """A peer marked its copy FAILED: everything read from it was dropped."""

    exposed: bool = False
    """Some of the dropped bytes had been published as filled (this copy's readers may hold
    them): this copy must fail too."""


class Filled:
    """Which bytes of the destination are valid, and how far they run in order from byte 0."""

    _gaps: tuple[object, Intervals] | None = None
    """The alignment gaps of the last layout seen, by its targets (the same object for every
    version of a layout)."""

    def __init__(self, plan: PullPlan) -> None:
        self.nbytes = plan.nbytes
        cached = Filled._gaps
        if cached is None or cached[0] is not plan.targets:
            gaps = Intervals([(0, plan.nbytes)])
            for t in plan.targets:
                gaps.remove(t.offset, t.offset + t.nbytes)
            cached = Filled._gaps = (plan.targets, gaps)
        self.valid = cached[1].copy()
        self.by_source: dict[str, Intervals] = {}
        self.published = 0
        """The largest prefix published so far (it never shrinks)."""
        self.started: float | None = None
        """Wall-clock time (time.time()) of the first read posted, over every run."""

    def add(self, source: str, ranges: np.ndarray) -> None:
        """`ranges` landed from `source`: theirs now, whoever delivered them before (a run
        after a fallback reads again the chunks an earlier run filled only in part)."""
        mine = self.by_source.setdefault(source, Intervals())
        others = [r for s, r in self.by_source.items() if s != source]
        for start, length in ranges:
            begin, end = int(start), int(start + length)
            for theirs in others:
                theirs.remove(begin, end)
            self.valid.add(begin, end)
            mine.add(begin, end)

    def bytes_by_source(self) -> dict[str, int]:
        """Valid bytes per source that delivered them last (runs that failed later
        included): they add up to the bytes read."""
        totals = {source: ranges.total for source, ranges in self.by_source.items()}
        return {source: total for source, total in totals.items() if total}

    def drop(self, source: str) -> bool:
        """Forget every byte `source` delivered; True when some of it was already published
        (readers of this copy may hold it)."""
        mine = self.by_source.pop(source, None)
        if mine is None:
            return False
        exposed = any(start < self.published for start, _ in mine)
        for start, end in mine:
            self.valid.remove(start, end)
        return exposed

    @property
    def complete(self) -> bool:
        return self.valid.covers(0, self.nbytes)

    def prefix(self) -> int:
        return self.valid.prefix()


_CUTS_KEPT = 16
_CUTS_LOCK = threading.Lock()
_CUTS: OrderedDict[bytes, tuple[tuple[Any, ...], ...]] = OrderedDict()
"""Chunks by `_cut_key`: the arrays of each are never written, so runs share them."""
_CUT_KEYS: OrderedDict[int, tuple[object, tuple[Any, ...], bytes]] = OrderedDict()
"""The last plans' reads digested, by the identity of their list (which each entry holds,
so it is not reused meanwhile), with the rest of the key and the digest."""


def _cut_key(
    plan: PullPlan, dest: Region, peers: Mapping[str, PeerGate], chunks: ChunkConfig
) -> bytes:
    """A digest of everything `PipelinedPull._cut` reads: where each read comes from and goes,
    the destination, the peers' bases and the chunk size (a new version of one layout differs
    only in its checksums, which chunks do not carry). A plan whose reads are the very list
    of a plan digested lately (a tree receiver replays its routed plan for every version)
    takes that digest again, without hashing every read's arrays at the pull's start. Under
    `_CUTS_LOCK`."""
    bases = tuple(sorted((agent, gate.base) for agent, gate in peers.items()))
    rest = (dest.address, dest.device_id, bases, chunks.chunk_bytes, chunks.taper)
    known = _CUT_KEYS.get(id(plan.reads))
    if known is not None and known[0] is plan.reads and known[1] == rest:
        return known[2]
    digest = hashlib.blake2b(repr(rest).encode(), digest_size=16)
    for reads in plan.reads:
        loc = reads.location
        digest.update(f"{loc.agent}|{loc.mem_type.value}|{loc.device_id}".encode())
        for array in (reads.remote_addresses, reads.lengths, reads.dest_offsets):
            digest.update(np.ascontiguousarray(array).tobytes())
    key = digest.digest()
    _CUT_KEYS[id(plan.reads)] = (plan.reads, rest, key)
    while len(_CUT_KEYS) > _CUTS_KEPT:
        _CUT_KEYS.popitem(last=False)
    return key


@dataclass(eq=False)
class _Chunk:
    agent: str
    mem_type: MemType
    remote: np.ndarray
    """N×3 uint64 (address, length, device) of the source's memory."""
    local: np.ndarray
    ranges: np.ndarray
    """N×2 int64 (destination offset, length)."""
    need: int
    """Bytes the source's copy must hold, from its first byte (0: a trainer rank)."""
    done_seq: int = -1

    @property
    def nbytes(self) -> int:
        return int(self.ranges[:, 1].sum())


@dataclass
class _Peer:
    gate: PeerGate
    word: ProgressWord | None = None
    poll: Posted | None = None
    poll_seq: int = 0
    polled: float = 0.0
    """time.monotonic() of the last one-sided read of its word posted."""
    file: ProgressFileReader | None = None
    advanced: float = field(default_factory=time.monotonic)
    unvalidated: list[_Chunk] = field(default_factory=list)
    used: bool = False


@dataclass(frozen=True)
class ChunkedStats:
    bytes_by_source: Mapping[str, int]
    reads: int
    chunks: int
    started: float
    """Wall-clock time of the first read posted (time.time())."""
    finished: float
    reading_s: float = 0.0
    """Seconds with reads in flight."""
    gated_s: float = 0.0
    """Seconds with no read in flight while reads remained: waiting for a parent's copy to
    advance. With `reading_s`, what tells a slow link from a slow parent."""
    prepared: int = 0
    """Chunk requests prepared anew (first read of those bytes of that source into that
    destination) rather than reused: a tree that changes shape between versions pays this."""


class ControlSlots:
    """Registered memory this receiver reads peers' progress words into: made by `words` (host
    memory by default; a receiver staging on a GPU uses device memory, so that reading a word
    next to a peer's device copy takes the same path as the data)."""

    def __init__(self, transport: NixlTransport, words: Callable[[int], Words] = HostWords) -> None:
        self._transport = transport
        self._make = words
        self._memory: Words | None = None
        self.region: Region | None = None
        self._readers: OrderedDict[ProgressFileRef, ProgressFileReader | None] = OrderedDict()

    def ensure(self, slots: int) -> Region:
        if self.region is not None and self.region.nbytes >= slots * _SLOT:
            return self.region
        self._release_region()
        self._memory = self._make(max(slots, 8) * _SLOT)
        self.region = self._memory.region
        self._transport.register(self.region)
        return self.region

    def word(self, slot: int) -> np.ndarray:
        assert self._memory is not None
        return self._memory.read(slot * _SLOT, PROGRESS_BYTES)

    def reader(self, ref: ProgressFileRef | None) -> ProgressFileReader | None:
        """A peer's progress file, opened once (the last few kept); None where there is none
        or it is not on this host."""
        if ref is None:
            return None
        if ref in self._readers:
            self._readers.move_to_end(ref)
            return self._readers[ref]
        opened = ProgressFileReader.open(ref)
        self._readers[ref] = opened
        while len(self._readers) > _READERS_KEPT:
            _, dropped = self._readers.popitem(last=False)
            if dropped is not None:
                dropped.close()
        return opened

    def release(self) -> None:
        for opened in self._readers.values():
            if opened is not None:
                opened.close()
        self._readers.clear()
        self._release_region()

    def _release_region(self) -> None:
        if self.region is not None:
            self._transport.deregister(self.region)
            self.region = None
            self._memory = None


class PipelinedPull:
    def __init__(
        self,
        transport: NixlTransport,
        control: ControlSlots,
        config: ChunkConfig,
        *,
        own: OwnProgress | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        verified_here: bool = False,
        trace: PullTrace | None = None,
    ) -> None:
        """`verified_here`: the caller checks every byte of the plan against the trainer's
        checksums after the run (`transport.verifies_every_read`), so a peer's chunk counts as
        it lands and the run does not wait for the peers to say COMPLETE."""
        self._transport = transport
        self._control = control
        self._config = config
        self._own = own
        self._on_progress = on_progress
        self._verified_here = verified_here
        self._trace = trace

    def run(
        self,
        plan: PullPlan,
        dest: Region,
        filled: Filled,
        *,
        peers: Mapping[str, PeerGate],
        deadline: float,
    ) -> ChunkedStats:
        """Read every byte of `plan` not valid in `filled` yet; SourceLost (with `agent`) when
        a source fails, `filled` then holding what did land. What lands is published (this
        receiver's word, `on_progress`) from a thread of its own, all of it before this
        returns or raises."""
        word = None if self._own is None else self._fill
        with ProgressPublisher(word, self._on_progress, name="pull-progress") as publisher:
            return self._run(
                plan, dest, filled, peers=peers, deadline=deadline, publisher=publisher
            )

    def _run(
        self,
        plan: PullPlan,
        dest: Region,
        filled: Filled,
        *,
        peers: Mapping[str, PeerGate],
        deadline: float,
        publisher: ProgressPublisher,
    ) -> ChunkedStats:
        run = self._start(plan, dest, filled, peers=peers, deadline=deadline, publisher=publisher)
        self._publish(filled, publisher)
        while True:
            run.progressed = False
            run.post()
            reading = bool(run.inflight)  # this turn of the loop had reads in flight
            run.ask_peers()
            run.collect()
            run.hear_peers()
            self._publish(filled, publisher)
            if run.over():
                return run.stats()
            run.watch()
            run.rest(reading)

    def _start(
        self,
        plan: PullPlan,
        dest: Region,
        filled: Filled,
        *,
        peers: Mapping[str, PeerGate],
        deadline: float,
        publisher: ProgressPublisher,
    ) -> _Run:
        """A run's state before its first turn: its chunks queued per source, its peers."""
        chunks = self._chunks(plan, dest, filled, peers)
        queues: dict[str, deque[_Chunk]] = {}
        for chunk in chunks:
            queues.setdefault(chunk.agent, deque()).append(chunk)
        state = {
            agent: _Peer(gate, file=self._control.reader(gate.file))
            for agent, gate in peers.items()
        }
        for agent in queues:
            if agent in state:
                state[agent].used = True
        control = self._control.ensure(len(peers))
        slots = {agent: i for i, agent in enumerate(peers)}
        return _Run(
            owner=self,
            transport=self._transport,
            trace=self._trace,
            verified_here=self._verified_here,
            plan=plan,
            dest=dest,
            filled=filled,
            deadline=deadline,
            publisher=publisher,
            queues=queues,
            peers=state,
            control=control,
            slots=slots,
            chunks=len(chunks),
        )

    # -- planning chunks ------------------------------------------------------------------------

    def _chunks(
        self, plan: PullPlan, dest: Region, filled: Filled, peers: Mapping[str, PeerGate]
    ) -> list[_Chunk]:
        """The run's chunks; a first run of a layout pulled before (every version of a steady
        tree) takes them from `_CUTS` instead of cutting the reads again."""
        if filled.by_source:  # a run after a source failed: only what did not land
            return self._cut(plan, dest, filled, peers)
        with _CUTS_LOCK:  # the ranks of a receiver process pull at once, from threads
            key = _cut_key(plan, dest, peers, self._config)
            cut = _CUTS.get(key)
            if cut is not None:
                _CUTS.move_to_end(key)
        if cut is None:
            cut = tuple(
                (c.agent, c.mem_type, c.remote, c.local, c.ranges, c.need)
                for c in self._cut(plan, dest, filled, peers)
            )
            with _CUTS_LOCK:
                _CUTS[key] = cut
                while len(_CUTS) > _CUTS_KEPT:
                    _CUTS.popitem(last=False)
        return [_Chunk(*fields) for fields in cut]

    def _cut(
        self, plan: PullPlan, dest: Region, filled: Filled, peers: Mapping[str, PeerGate]
    ) -> list[_Chunk]:
        size = self._config.chunk_bytes
        by_source: dict[tuple[str, MemType], list[tuple[np.ndarray, ...]]] = {}
        for reads in plan.reads:
            loc = reads.location
            by_source.setdefault((loc.agent, loc.mem_type), []).append(
                (reads.remote_addresses, reads.lengths.astype(np.uint64), reads.dest_offsets)
            )
        out: list[_Chunk] = []
        for (agent, mem_type), parts in by_source.items():
            remote = np.concatenate([p[0] for p in parts])
            length = np.concatenate([p[1] for p in parts]).astype(np.int64)
            dst = np.concatenate([p[2] for p in parts]).astype(np.int64)
            device = next(r.location.device_id for r in plan.reads if r.location.agent == agent)
            gate = peers.get(agent)
            # A peer's copy is read in the order of its own buffer, a trainer rank's in the
            # destination's; chunks are cut along that order.
            order = np.argsort(remote if gate is not None else dst, kind="stable")
            remote, length, dst = remote[order], length[order], dst[order]
            bounds = chunk_bounds(int(length.sum()), size, self._config.taper)
            remote, length, dst, chunk = cut_at(remote, length, dst, bounds)
            if filled.by_source:  # a run after a source failed: skip what did land
                keep = np.array(
                    [
                        not filled.valid.covers(int(d), int(d + n))
                        for d, n in zip(dst, length, strict=True)
                    ],
                    dtype=bool,
                )
                remote, dst, length, chunk = remote[keep], dst[keep], length[keep], chunk[keep]
            if not len(length):
                continue
            remote, length, dst, chunk = merge_continuing(remote, length, dst, chunk)
            for idx in np.split(np.arange(len(chunk)), np.flatnonzero(np.diff(chunk)) + 1):
                r, n, d = remote[idx], length[idx], dst[idx]
                dev = np.full(len(idx), device, np.uint64)
                local = np.stack(
                    [
                        d.astype(np.uint64) + np.uint64(dest.address),
                        n.astype(np.uint64),
                        np.full(len(idx), dest.device_id, np.uint64),
                    ]
                ).T
                need = 0 if gate is None else int((r + n.astype(np.uint64)).max()) - gate.base
                out.append(
                    _Chunk(
                        agent,
                        mem_type,
                        np.ascontiguousarray(np.stack([r, n.astype(np.uint64), dev]).T),
                        np.ascontiguousarray(local),
                        np.stack([d, n]).T,
                        need,
                    )
                )
        return out

    # -- reading peers' words ------------------------------------------------------------------

    def _post_poll(self, record: AgentRecord, peer: _Peer, control: Region, slot: int) -> Posted:
        loc = peer.gate.progress
        remote = np.array([[loc.address, PROGRESS_BYTES, loc.device_id]], np.uint64)
        local = np.array(
            [[control.address + slot * _SLOT, PROGRESS_BYTES, control.device_id]], np.uint64
        )
        return self._transport.post(record, loc.mem_type, remote, local, control)

    def _observe(
        self, agent: str, peer: _Peer, version: int, filled: Filled, *, raw: np.ndarray, seq: int
    ) -> SourceLost | None:
        """The peer's word as read (`raw`) when `seq` chunks had landed: a copy that failed or
        moved on is lost; chunks that landed before the read count."""
        try:
            word = ProgressWord.decode(raw)
        except TornRead:
            return None  # read again next round
        if word.version > version or (
            word.version == version and word.state is CopyProgress.FAILED
        ):
            if word.version == version:
                return SourceFailed(f"{agent}: its copy of version {version} failed", agent=agent)
            return SourceLost(
                f"{agent}: moved on to version {word.version} while serving {version}", agent=agent
            )
        if word.version < version:
            return None  # it has not started this version yet
        old = peer.word
        if old is not None and old.version == version:
            # The file and the word in registered memory may lag each other: keep the most
            # either has said (more filled; COMPLETE stays unless a word says FAILED).
            state = old.state if old.state is CopyProgress.COMPLETE else word.state
            word = ProgressWord(version, max(word.filled, old.filled), state)
        if old is None or word.filled > old.filled or word.state is not old.state:
            peer.advanced = time.monotonic()
            if self._trace is not None and (old is None or word.filled > old.filled):
                self._trace.add(TraceEvent.SAW, agent, word.filled)
        peer.word = word
        # Chunks that landed before this read was posted are valid: the copy was still this
        # version's, unfailed, after they were read.
        valid = [c for c in peer.unvalidated if c.done_seq < seq]
        peer.unvalidated = [c for c in peer.unvalidated if c.done_seq >= seq]
        for chunk in valid:
            filled.add(agent, chunk.ranges)
        return None

    def _fill(self, prefix: int) -> None:
        """On the publisher's thread: this receiver's fill, for its children."""
        assert self._own is not None
        if self._trace is not None:
            self._trace.add(TraceEvent.FILLED, value=prefix)
        self._own.filled(prefix)

    @staticmethod
    def _publish(filled: Filled, publisher: ProgressPublisher) -> None:
        """Hands a grown prefix to the publisher (counted as published from here: a source
        failing later treats readers of this copy as possibly holding it)."""
        prefix = filled.prefix()
        if prefix <= filled.published:
            return
        filled.published = prefix
        publisher.offer(prefix, filled.nbytes)


@dataclass(eq=False, slots=True)
class _Run:
    """One run's state (`PipelinedPull._run`): the chunks queued per source and in flight, what
    each peer's word said, the run's first failure, and its clocks. A turn of the loop posts
    the chunks whose bytes their sources hold (`post`), asks the peers something waits on how
    far they are (`ask_peers`), takes what landed (`collect`) and what the peers answered
    (`hear_peers`), then ends (`over`), watches for stalls and the deadline (`watch`), and
    rests when it made no progress (`rest`)."""

    owner: PipelinedPull
    transport: NixlTransport
    trace: PullTrace | None
    verified_here: bool
    plan: PullPlan
    dest: Region
    filled: Filled
    deadline: float
    publisher: ProgressPublisher
    queues: dict[str, deque[_Chunk]]
    """The chunks not posted yet, per source, each in its source's order."""
    peers: dict[str, _Peer]
    control: Region
    slots: dict[str, int]
    """Each peer's slot in `control`, where its word is read into."""
    chunks: int
    inflight: list[tuple[_Chunk, Posted]] = field(default_factory=list)
    bytes_by: dict[str, int] = field(default_factory=dict)
    seq: int = 0
    """Chunks landed so far: a peer's word read after the seq-th landed validates those
    before it."""
    reads: int = 0
    started: float | None = None
    failure: SourceLost | None = None
    """The first source lost: the run raises it once nothing of it is in flight."""
    pause: float = 0.0
    reading_s: float = 0.0
    gated_s: float = 0.0
    prepared: int = 0
    mark: float = field(default_factory=time.perf_counter)
    progressed: bool = False
    """This turn posted, landed or heard something."""
    following: bool = False
    """This turn follows a peer's file whose copy advanced lately."""

    def post(self) -> None:
        """Post chunks whose bytes their source holds, round robin over sources."""
        while self.failure is None and len(self.inflight) < self.owner._config.window:
            ready = self._next_ready()
            if ready is None:
                break
            record = self.plan.agents[ready.agent]
            try:
                posted = self.transport.post(
                    record, ready.mem_type, ready.remote, ready.local, self.dest
                )
            except SourceLost as e:
                self._fail(e, ready.agent, drop=False)
                break
            if self.started is None:
                self.started = time.time()
                if self.filled.started is None:
                    self.filled.started = self.started
            self.inflight.append((ready, posted))
            if self.trace is not None:
                self.trace.add(TraceEvent.POSTED, ready.agent, ready.nbytes)
            self.prepared += posted.prepared
            self.reads += len(ready.ranges)
            self.progressed = True

    def ask_peers(self) -> None:
        """Ask peers how far they are when something waits on them: a peer's file on this
        host at every turn, its word one-sidedly (for a file, as a heartbeat)."""
        self.following = False
        if self.failure is not None:
            return
        now = time.monotonic()
        for agent, peer in self.peers.items():
            if not self._waits_on(agent, peer):
                continue
            if peer.file is not None:
                # Closely while its copy moves; a stalled one only as often as a word.
                self.following = self.following or now - peer.advanced < _FOLLOW_CLOSELY_S
                before = peer.advanced
                lost = self.owner._observe(
                    agent, peer, self.plan.version, self.filled, raw=peer.file.read(), seq=self.seq
                )
                self.progressed = self.progressed or lost is not None or peer.advanced != before
                if lost is not None:
                    self._fail(lost, agent, drop=True)
                    break
                if now - peer.polled < HEARTBEAT_S:
                    continue
            if peer.poll is None:
                try:
                    peer.poll = self.owner._post_poll(
                        self.plan.agents[agent], peer, self.control, self.slots[agent]
                    )
                except SourceLost as e:
                    self._fail(e, agent, drop=False)
                    break
                peer.poll_seq = self.seq
                peer.polled = now

    def collect(self) -> None:
        """Take the chunks that landed: a trainer rank's count at once, a peer's once a later
        read of its word vouches for them (unless every byte is verified here)."""
        for item in list(self.inflight):
            chunk, posted = item
            try:
                done = self.transport.check(posted)
            except SourceLost as e:
                self.inflight.remove(item)
                self._fail(e, chunk.agent, drop=True)
                continue
            if not done:
                continue
            self.inflight.remove(item)
            self.progressed = True
            if self.trace is not None:
                self.trace.add(TraceEvent.LANDED, chunk.agent, chunk.nbytes)
            self.bytes_by[chunk.agent] = self.bytes_by.get(chunk.agent, 0) + chunk.nbytes
            if chunk.agent in self.peers and not self.verified_here:
                chunk.done_seq = self.seq
                self.peers[chunk.agent].unvalidated.append(chunk)
            else:
                self.filled.add(chunk.agent, chunk.ranges)
            self.seq += 1

    def hear_peers(self) -> None:
        """Take the peers' words whose one-sided reads landed."""
        for agent, peer in self.peers.items():
            if peer.poll is None:
                continue
            try:
                if not self.transport.check(peer.poll):
                    continue
            except SourceLost as e:
                peer.poll = None
                self._fail(e, agent, drop=True)
                continue
            peer.poll = None
            # A word that did not move is no progress: the loop backs off before asking
            # again, rather than keeping the GPU's copy queue full of 24-byte reads.
            before = peer.advanced
            lost = self.owner._observe(
                agent,
                peer,
                self.plan.version,
                self.filled,
                raw=self.owner._control.word(self.slots[agent]),
                seq=peer.poll_seq,
            )
            self.progressed = self.progressed or lost is not None or peer.advanced != before
            if lost is not None:
                self._fail(lost, agent, drop=True)

    def over(self) -> bool:
        """Whether every byte is in and every peer read from settled; a failure is raised
        once nothing of the run is in flight."""
        if self.failure is not None:
            if not self.inflight and all(p.poll is None for p in self.peers.values()):
                raise self.failure
            return False
        return not self.inflight and not any(self.queues.values()) and self._peers_settled()

    def watch(self) -> None:
        """A peer waited on whose copy stopped advancing, or a run past its deadline, is a
        source lost."""
        if self.failure is not None:
            return
        now = time.monotonic()
        stall_s = self.owner._config.stall_timeout_s
        for agent, peer in self.peers.items():
            if self._waits_on(agent, peer) and now - peer.advanced > stall_s:
                error = SourceLost(
                    f"{agent}: its copy did not advance for {stall_s:g} s", agent=agent
                )
                self._fail(error, agent, drop=True)
                break
        if self.failure is None and now > self.deadline:
            late = self._late()
            error = SourceLost(f"{late}: pull not done by its deadline", agent=late)
            self._fail(error, late, drop=True)

    def rest(self, reading: bool) -> None:
        """Back off after a turn without progress; count the turn as reading or gated."""
        gated = not reading and self.failure is None and any(self.queues.values())
        if self.progressed:
            self.pause = 0.0
            if self.publisher.busy:
                time.sleep(_YIELD_S)  # the publisher's lanes take the interpreter now
        else:
            time.sleep(self.pause)
            # Reads in flight land within tens of microseconds on a GPU link: poll them
            # closely; a pull waiting only on a parent's progress backs off further. A peer
            # followed through its file costs nothing to look at: closely too, while it
            # advances.
            close = self.inflight or self.following
            self.pause = min(2 * self.pause or 1e-5, 5e-5 if close else 5e-4)
        now = time.perf_counter()
        if reading:
            self.reading_s += now - self.mark
        elif gated:
            self.gated_s += now - self.mark
        self.mark = now

    def stats(self) -> ChunkedStats:
        finished = time.time()
        return ChunkedStats(
            self.bytes_by,
            self.reads,
            self.chunks,
            self.started or finished,
            finished,
            self.reading_s,
            self.gated_s,
            self.prepared,
        )

    def _fail(self, error: SourceLost, agent: str, *, drop: bool) -> None:
        """`agent` is lost (unless the run failed already); `drop`: its chunks in flight no
        longer count."""
        if self.failure is None:
            self.failure = self._lose(error, agent)
        if drop:
            self.inflight = [i for i in self.inflight if i[0].agent != agent]

    def _lose(self, error: SourceLost, agent: str) -> SourceLost:
        self.transport.forget(agent)
        peer = self.peers.get(agent)
        if peer is not None:
            peer.poll = None
            peer.unvalidated = []
        if isinstance(error, SourceFailed):
            # Only a copy that serves others can have forwarded the bytes.
            error.exposed = self.filled.drop(agent) and self.owner._own is not None
        error.agent = error.agent or agent
        return error

    def _next_ready(self) -> _Chunk | None:
        queues = self.queues
        for agent in list(queues):
            queue = queues[agent]
            if not queue:
                continue
            head = queue[0]
            peer = self.peers.get(agent)
            if peer is not None:
                word = peer.word
                if word is None or word.filled < head.need:
                    continue
            queue.popleft()
            # Rotate: the next call starts with another source.
            queues[agent] = queues.pop(agent)
            return head
        return None

    def _waits_on(self, agent: str, peer: _Peer) -> bool:
        queue = self.queues.get(agent)
        if queue and (peer.word is None or peer.word.filled < queue[0].need):
            return True
        if peer.unvalidated:
            return True
        return (
            not self.verified_here
            and peer.used
            and (peer.word is None or peer.word.state is not CopyProgress.COMPLETE)
        )

    def _late(self) -> str:
        """The source a run past its deadline waits on."""
        if self.inflight:
            return self.inflight[0][0].agent
        for agent, peer in self.peers.items():
            if self._waits_on(agent, peer):
                return agent
        return next((a for a, q in self.queues.items() if q), "")

    def _peers_settled(self) -> bool:
        return all(
            not p.used
            or (
                not p.unvalidated
                and p.word is not None
                and (self.verified_here or p.word.state is CopyProgress.COMPLETE)
            )
            for p in self.peers.values()
        )
