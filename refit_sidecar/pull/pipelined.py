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

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from refit_sidecar.core.manifest import AgentRecord
from refit_sidecar.core.plan import PullPlan
from refit_sidecar.memory.region import Region
from refit_sidecar.pull.announcer import ProgressPublisher
from refit_sidecar.pull.filled import Filled
from refit_sidecar.pull.nixl_transport import NixlTransport, Posted
from refit_sidecar.pull.peer_words import SLOT_BYTES, ControlSlots, PeerGate
from refit_sidecar.pull.pipelined_chunks import Chunk, chunks_of
from refit_sidecar.pull.progress import (
    PROGRESS_BYTES,
    CopyProgress,
    OwnProgress,
    ProgressWord,
    TornRead,
)
from refit_sidecar.pull.running_check import DEFAULT_PART_BYTES
from refit_sidecar.pull.shared_word import ProgressFileReader
from refit_sidecar.pull.trace import PullTrace, TraceEvent
from refit_sidecar.pull.transport import SourceLost

_FOLLOW_CLOSELY_S = 0.005
"""A peer followed through its file whose copy advanced this recently is looked at closely
(`_Run.rest`); one that did not, less often (a stalled parent costs no busy loop)."""

_YIELD_S = 2e-5
"""A turn of the loop that made progress sleeps this long while the progress publisher has
work (`ProgressPublisher.busy`), so its lanes get the interpreter between the loop's turns."""

HEARTBEAT_S = 0.005
"""A peer followed through its progress file has its word read one-sidedly this often too:
the read fails at once when the peer died, while its file only stops changing."""


DEFAULT_CHUNK_BYTES = 256 << 20
"""Each chunk costs a fixed overhead of its own (its gate, post and progress update), whatever
its size, while a level of the tree lags its parent by about one chunk: large chunks, a short
lag at device bandwidths (BENCHMARKS.md, refit_fanout)."""


@dataclass(frozen=True, kw_only=True)
class ChunkConfig:
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Bytes per chunk: a child reads a parent's chunk once the parent has all of it."""
    window: int = 4
    """Chunks in flight at once, over all sources."""
    trace: bool = False
    """Record each pull's timeline (`trace.py`) into its stats."""
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
    unvalidated: list[Chunk] = field(default_factory=list)
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

    def _chunks(
        self, plan: PullPlan, dest: Region, filled: Filled, peers: Mapping[str, PeerGate]
    ) -> list[Chunk]:
        """The run's chunks (`pipelined_chunks.chunks_of`)."""
        config = self._config
        return chunks_of(
            plan, dest, filled, peers, chunk_bytes=config.chunk_bytes, taper=config.taper
        )

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
        queues: dict[str, deque[Chunk]] = {}
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

    # -- reading peers' words ------------------------------------------------------------------

    def _post_poll(self, record: AgentRecord, peer: _Peer, control: Region, slot: int) -> Posted:
        loc = peer.gate.progress
        remote = np.array([[loc.address, PROGRESS_BYTES, loc.device_id]], np.uint64)
        local = np.array(
            [[control.address + slot * SLOT_BYTES, PROGRESS_BYTES, control.device_id]], np.uint64
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
    queues: dict[str, deque[Chunk]]
    """The chunks not posted yet, per source, each in its source's order."""
    peers: dict[str, _Peer]
    control: Region
    slots: dict[str, int]
    """Each peer's slot in `control`, where its word is read into."""
    chunks: int
    inflight: list[tuple[Chunk, Posted]] = field(default_factory=list)
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

    def _next_ready(self) -> Chunk | None:
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
