"""A receiver's pull through the source tree (docs/fanout.md): ask the sidecar where to read,
read in chunks gated on each peer's progress, fall back when a source fails, verify against
the trainer's checksums, and serve the copy to later receivers.

`TreePull.pull(plan, staging, ...)` takes the receiver's own plan of the version (planned from
the trainer's manifest: its targets say where each wanted box lands in staging, its reads
carry the trainer's checksums) and fills staging with the same bytes, read from wherever the
tree says. The copy is offered to later receivers from the start (a filling peer); the sidecar
first drains the readers of this receiver's previous copy, and only then is staging
overwritten. Nothing is verified or marked COMPLETE until every byte is in; a receiver whose
pull fails marks its copy FAILED, so its own readers drop what they read from it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from refit_sidecar.core.manifest import AgentRecord, ShardLocation
from refit_sidecar.core.plan import PullPlan, Want, plan_pull
from refit_sidecar.integrity.checksum import ChecksumMismatch
from refit_sidecar.integrity.partial_sums import PartialSums
from refit_sidecar.integrity.verify import verifies_every_read
from refit_sidecar.memory.region import Region
from refit_sidecar.pull.filled import Filled
from refit_sidecar.pull.leasing import AskedAhead
from refit_sidecar.pull.nixl_transport import NixlTransport
from refit_sidecar.pull.peer_words import ControlSlots, PeerGate
from refit_sidecar.pull.pipelined import ChunkConfig, PipelinedPull, SourceFailed
from refit_sidecar.pull.progress import PROGRESS_BYTES, CopyProgress, HostWords, OwnProgress, Words
from refit_sidecar.pull.routing import one_source, peer_bases, route_manifest
from refit_sidecar.pull.running_check import RunningCheck
from refit_sidecar.pull.shared_word import DEFAULT_DIR, ProgressFile
from refit_sidecar.pull.trace import Event, PullTrace, TraceEvent
from refit_sidecar.pull.transport import SourceLost
from refit_sidecar.service.client import Lease, SidecarClient, UnknownVersion, lease_from_proto
from refit_sidecar.service.sources import Answer, NoSourceFree, Offer, get_sources_request
from trainer_refit.v1 import refit_pb2 as pb

log = logging.getLogger(__name__)

_KNOWN_ANSWERS = 16
"""Routed plans kept: a steady tree over a few trainer slots repeats its answers."""
_MAX_ATTEMPTS = 16
"""Source assignments per pull: each failed source costs one."""


class TreePullError(RuntimeError):
    """The pull did not complete; nothing of it may be used."""


@dataclass(frozen=True, kw_only=True)
class TreePullConfig:
    chunks: ChunkConfig = field(default_factory=ChunkConfig)
    domain: str = ""
    """Topology domain (node, rack): the sidecar prefers sources of the same domain."""
    serve: bool = True
    """Offer this receiver's copy to later receivers."""
    verify: bool = True
    """Check the trainer's checksums of every trainer shard staged whole (on the staging's
    device)."""
    progress_dir: str = DEFAULT_DIR
    """Where this receiver mirrors its progress word in a file, for children on its host
    (`shared_word.py`); "" for no file (children read the word one-sidedly)."""


@dataclass(frozen=True)
class TreePullStats:
    nbytes: int
    seconds: float
    reads: int
    """Byte ranges read by the run that completed the pull (runs cut short by a failed
    source are not counted)."""
    chunks: int
    verified_shards: int
    partial_sums: PartialSums | None
    """When verifying: the sums of the reads of parts of shards (`partial_sums`)."""
    bytes_by_source: dict[str, int]
    started: float
    """Wall-clock time (time.time()) of the first read."""
    finished: float
    fallbacks: int
    """Sources lost and replaced during the pull."""
    ask_s: float = 0.0
    """Seconds spent asking the sidecar for sources (GetSources, its retries included)."""
    reading_s: float = 0.0
    """Of the run that completed the pull: seconds with reads in flight."""
    gated_s: float = 0.0
    """Of the run that completed the pull: seconds waiting for a parent's copy to advance
    with nothing else to read."""
    prepared: int = 0
    """Of the run that completed the pull: chunk requests prepared anew, not reused."""
    asked_ahead: bool = False
    """The lease and the sources came from `TreePull.ask_ahead` (`ask_s` is then the wait
    for that answer, about nothing once the lease is in)."""
    routes_left_out: bool = False
    """The answer that completed the pull left its routes out: this receiver named the key of
    the plan it held, and replayed it."""
    trace: tuple[Event, ...] = ()
    """The pull's timeline, when `ChunkConfig.trace` is on (`trace.py`)."""


def _lease_in(sent: float) -> Callable[[Answer], Lease]:
    """The lease in a GetSources answer, its end counted from `sent` (time.monotonic())."""

    def lease(answer: Answer) -> Lease:
        return lease_from_proto(answer.reply.lease, sent)

    return lease


class TreePull:
    def __init__(
        self,
        client: SidecarClient,
        transport: NixlTransport,
        agent: str,
        config: TreePullConfig,
        *,
        words: Callable[[int], Words] = HostWords,
    ) -> None:
        """`words` makes the memory of this receiver's progress word and of the slots it reads
        its parents' words into: where its staging is (device memory for a GPU's)."""
        self._client = client
        self._transport = transport
        self._agent = agent
        self.config = config
        mirror = None
        if config.serve and config.progress_dir:
            mirror = ProgressFile.create(config.progress_dir)
        self._own = OwnProgress(agent, words(PROGRESS_BYTES), mirror=mirror)
        transport.register(self._own.region)
        self._control = ControlSlots(transport, words)
        self._plans: OrderedDict[bytes, tuple[PullPlan, dict[str, PeerGate]]] = OrderedDict()
        """Routed plans by `Sources.key`: GetSources names their keys (`known_routing_keys`)."""
        self._primaries: dict[bytes, tuple[str, ...]] = {}
        """Each routed plan's primaries, by key (an answer that leaves its routes out)."""
        self._last_offer: tuple[object, Offer] | None = None
        self._last_wants: tuple[object, list[Want]] | None = None
        self._request: tuple[object, pb.GetSourcesRequest] | None = None
        """The last GetSources request built, by (wants, offer): reused with a new version."""
        self._offered: int | None = None
        """The version this receiver's copy is offered for."""
        self._releases = ThreadPoolExecutor(1, thread_name_prefix=f"release-{agent}")
        """ReleaseSources goes out in the background, in order: off the refit's path. A
        GetSources asked ahead waits for the release before it (`_settle`)."""
        self._released: Future[None] | None = None
        self._ahead: AskedAhead[Answer] | None = None
        self._started: int | None = None
        """The version this receiver's copy was started for ahead of its pull
        (`ahead_lease`), if any; the pull then settles that start instead of starting."""

    def ask_ahead(
        self, version: int, *, wait_s: float, lease_ttl_s: float, checksums: bool
    ) -> None:
        """Ask, in one GetSources left in flight, for a lease on `version` (for `lease_ttl_s`,
        with its checksums if `checksums`) and its sources as the last pull asked (a
        receiver's wants and staging stay the same). The sidecar answers once the version is
        readable (waiting up to `wait_s`), so a tree's receivers are assigned one after
        another on the sidecar, without a round trip between them; asked before the version
        is published, the answer comes the moment it is. `ahead_lease` waits for the lease;
        the next `pull` of `version` takes the sources when its wants and offer are those;
        `abandon` drops both (cancelling the call if it is still in flight). Nothing happens
        before a first pull (its wants are not known yet)."""
        self.abandon()
        if self._request is None:
            return
        key, template = self._request
        request = pb.GetSourcesRequest()
        request.CopyFrom(template)
        request.version = version
        request.wait_seconds = wait_s
        request.lease_ttl_seconds = lease_ttl_s
        request.lease_with_checksums = checksums
        self._name_known_keys(request)
        self._settle()  # the sidecar sees this receiver's calls in order
        sent = time.monotonic()
        self._ahead = AskedAhead(version, self._client.ask_later(request), _lease_in(sent), key)

    def asked(self, version: int) -> bool:
        """Whether a GetSources asked ahead for `version` is in flight or answered."""
        return self._ahead is not None and self._ahead.version == version

    def ahead_lease(self) -> tuple[Lease | None, BaseException | None]:
        """Waits for the answer asked ahead: its lease (the caller then holds and ends it), or
        the sidecar's refusal of the call. (None, None) when nothing was asked ahead."""
        ahead = self._ahead
        if ahead is None:
            return None, None
        lease = ahead.lease()
        ahead.taken = lease is not None
        if lease is not None and self.config.serve:
            # The sidecar drained the readers of this receiver's previous copy before it
            # answered: the copy's word starts the new version now, queued (a GPU's word is a
            # copy), while the caller plans; the pull waits for it to land before its first
            # read (`OwnProgress.flush`), by then as a rule long done. (Written and waited for
            # on the release thread, they held the pull back after planning, the planning
            # thread holding the interpreter: docs/fanout.md, step 2.)
            self._settle()
            self._own.start(ahead.version, wait=False)
            self._offered = self._started = ahead.version
        return lease, ahead.answer.exception()

    def abandon(self) -> None:
        """Drop a GetSources asked ahead and not used, without waiting for it. One still in
        flight is cancelled (the sidecar assigns nothing to a cancelled call; one it answered
        at that very moment is released as failed, and its lease runs out at its TTL). When
        the answer is in already, this receiver's copy of that version (offered to readers,
        never to be filled) is marked FAILED, so readers drop it at once, and its assignment
        and lease are released."""
        ahead, self._ahead = self._ahead, None
        self._started = None
        if ahead is None:
            return
        if ahead.answer.cancel():
            self._release(ahead.version, complete=False)
            return
        if ahead.answer.exception() is not None:
            return  # nothing was assigned
        if self.config.serve:
            self._settle()
            self._own.start(ahead.version)
            self._offered = ahead.version
        self._fail(ahead.version)
        if not ahead.taken:
            self._released = self._releases.submit(self._end_lease, ahead)

    def _end_lease(self, ahead: AskedAhead[Answer]) -> None:
        lease = ahead.lease()
        if lease is not None:
            self._client.end_lease(lease)

    def _take_ahead(self, version: int, key: object) -> Answer | None:
        """The answer asked ahead for this pull; None (and any other one abandoned) when there
        is none, it was for another version or other wants, or the sidecar refused it."""
        ahead = self._ahead
        if ahead is None:
            return None
        if ahead.version != version or ahead.key != key:
            self.abandon()
            return None
        self._ahead = None
        try:
            return ahead.answer.result()
        except Exception as e:  # asked again at once, as without asking ahead
            log.debug("version %d: the sources asked ahead were not given: %s", version, e)
            return None

    def pull(
        self,
        plan: PullPlan,
        staging: Region,
        *,
        deadline: float,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> TreePullStats:
        """Fill `staging` with `plan`'s bytes through the tree; TreePullError (or the
        sidecar's error) when it cannot, this receiver's copy then marked FAILED and its
        pull released as failed, so nothing of it is used here or by its readers."""
        try:
            return self._pull(plan, staging, deadline, on_progress)
        except BaseException:
            self._fail(plan.version)
            raise

    def _pull(
        self,
        plan: PullPlan,
        staging: Region,
        deadline: float,
        on_progress: Callable[[int, int], None] | None,
    ) -> TreePullStats:
        version = plan.version
        wants = self._wants(plan)
        offer = self._offer(plan, staging) if self.config.serve else None
        filled = Filled(plan)
        check = (
            RunningCheck(plan, staging, part_bytes=self.config.chunks.check_part_bytes)
            if self.config.verify
            else None
        )
        trace = PullTrace() if self.config.chunks.trace else None
        if trace is not None:
            trace.add(TraceEvent.BEGAN)
        runner = PipelinedPull(
            self._transport,
            self._control,
            self.config.chunks,
            own=self._own if offer is not None else None,
            on_progress=_checking(check, on_progress, trace),
            verified_here=self.config.verify and verifies_every_read(plan, staging),
            trace=trace,
        )
        begin = time.perf_counter()
        lost: list[str] = []
        reads = chunks = fallbacks = 0
        started_copy = False
        gone: set[str] = set()
        ahead = self._take_ahead(version, (tuple(wants), offer))
        asked_ahead = ahead is not None
        left_out = False
        ask_s = time.perf_counter() - begin  # waiting for the answer asked ahead, if any
        for _ in range(_MAX_ATTEMPTS):
            asked = time.perf_counter()
            sources = ahead or self._sources(version, wants, offer, lost, deadline)
            ask_s += time.perf_counter() - asked
            ahead = None
            if trace is not None:
                trace.add(TraceEvent.ANSWERED)
            again = sorted(gone.intersection(self._primaries_of(sources)))
            if again:
                # The sidecar knows no other source for those bytes (a trainer rank stays a
                # source while its version is readable, even when a receiver lost it).
                raise TreePullError(
                    f"version {version}: no source other than {again}, which failed this pull"
                )
            if offer is not None and not started_copy:
                self._start_copy(version, trace)
                started_copy = True
            routed, gates = self._routed(sources, plan, wants)
            left_out = sources.reply.routes_left_out
            try:
                stats = runner.run(routed, staging, filled, peers=gates, deadline=deadline)
            except SourceLost as e:
                if check is not None:
                    check.restart()
                _fall_back_or_fail(e, deadline)
                lost, fallbacks = [e.agent or ""], fallbacks + 1
                gone.update(lost)
                log.warning("version %d: %s; asking for another source", version, e)
                continue
            reads += stats.reads
            chunks += stats.chunks
            completing = stats
            break
        else:
            raise TreePullError(f"version {version}: {_MAX_ATTEMPTS} sources failed in turn")
        verified = 0 if check is None else _verified(check, filled, trace)
        # The word says COMPLETE, then the sidecar hears of the release: both in the
        # background, in that order. The write waits for the GPU's copy queue (long while
        # children copy from this GPU), and a child checking its reads itself never
        # waits for this word.
        self._released = self._releases.submit(self._complete, version, offer is not None)
        # What stayed valid, per source: bytes read from a source that failed later count.
        by_source = filled.bytes_by_source()
        return TreePullStats(
            nbytes=sum(by_source.values()),
            seconds=time.perf_counter() - begin,
            reads=reads,
            chunks=chunks,
            verified_shards=verified,
            partial_sums=None if check is None else check.partial,
            bytes_by_source=by_source,
            started=filled.started or time.time(),
            finished=time.time(),
            fallbacks=fallbacks,
            ask_s=ask_s,
            reading_s=completing.reading_s,
            gated_s=completing.gated_s,
            prepared=completing.prepared,
            asked_ahead=asked_ahead and fallbacks == 0,
            routes_left_out=left_out,
            trace=() if trace is None else tuple(trace.events),
        )

    def _start_copy(self, version: int, trace: PullTrace | None) -> None:
        """The sidecar drained the readers of the previous copy: overwrite from here (after
        the last copy's word writes, which run in the background)."""
        self._settle()
        if self._started == version:
            self._own.flush()
        else:
            self._own.start(version)
        self._offered, self._started = version, None
        if trace is not None:
            trace.add(TraceEvent.RESET)

    def _wants(self, plan: PullPlan) -> list[Want]:
        """What `plan` reads, as the sidecar is asked for it: the same objects for every
        version of one layout, so comparing an answer's key with the pull's costs nothing."""
        last = self._last_wants
        if last is None or last[0] is not plan.targets:
            last = (plan.targets, [Want(t.name, t.box) for t in plan.targets])
            self._last_wants = last
        return last[1]

    def _name_known_keys(self, request: pb.GetSourcesRequest) -> None:
        request.known_routing_keys.extend(self._plans)

    def _primaries_of(self, answer: Answer) -> tuple[str, ...]:
        if not answer.reply.routes_left_out:
            return answer.primaries
        primaries = self._primaries.get(answer.key)
        if primaries is None or answer.key not in self._plans:
            raise TreePullError("the sidecar left out routes of a plan this receiver dropped")
        return primaries

    def _routed(
        self, answer: Answer, plan: PullPlan, wants: list[Want]
    ) -> tuple[PullPlan, dict[str, PeerGate]]:
        """The plan reading what the tree chose, and the gates of the peers it reads; an
        answer met before (same routes, same memory: a steady tree over the trainer's slots)
        replays its plan and parses nothing (the sidecar then leaves its routes out)."""
        cached = self._plans.get(answer.key)
        if cached is not None:
            self._plans.move_to_end(answer.key)
            return replace(cached[0], version=answer.version), cached[1]
        if answer.reply.routes_left_out:
            raise TreePullError("the sidecar left out routes of a plan this receiver dropped")
        fast = one_source(answer, plan)
        if fast is not None:
            self._keep(answer, fast)
            return fast
        sources = answer.sources(copies_of=answer.primaries)
        routed = plan_pull(route_manifest(sources), wants)
        if [(t.name, t.box, t.offset) for t in routed.targets] != [
            (t.name, t.box, t.offset) for t in plan.targets
        ]:
            raise TreePullError("the routed plan lays staging out differently: a bug")
        gates = {}
        for source, base in peer_bases(sources, routed.agents).items():
            copy = sources.copies[source]
            if copy.progress is None:
                raise TreePullError(f"peer {source!r} was sent without its progress word")
            gates[source] = PeerGate(copy.progress, base, copy.progress_file)
        self._keep(answer, (routed, gates))
        return routed, gates

    def _keep(self, answer: Answer, routed: tuple[PullPlan, dict[str, PeerGate]]) -> None:
        self._plans[answer.key] = routed
        self._primaries[answer.key] = answer.primaries
        while len(self._plans) > _KNOWN_ANSWERS:
            dropped, _ = self._plans.popitem(last=False)
            self._primaries.pop(dropped, None)

    def _offer(self, plan: PullPlan, staging: Region) -> Offer:
        """This receiver's copy as it offers it: the same for every version that lands in
        the same staging with the same layout, so it is built (metadata included) once."""
        key = (staging, plan.targets)
        if self._last_offer is not None and self._last_offer[0] == key:
            return self._last_offer[1]
        locations = tuple(
            ShardLocation.contiguous(
                agent=self._agent,
                address=staging.address + t.offset,
                shape=t.box.shape,
                itemsize=t.dtype.itemsize,
                mem_type=staging.mem_type,
                device_id=staging.device_id,
            )
            for t in plan.targets
        )
        record = AgentRecord(self._agent, metadata=self._transport.metadata())
        mirror = self._own.mirror
        offer = Offer(record, locations, self._own.location, None if mirror is None else mirror.ref)
        self._last_offer = (key, offer)
        return offer

    def _sources(
        self, version: int, wants: list[Want], offer: Offer | None, lost: list[str], deadline: float
    ) -> Answer:
        key = (tuple(wants), offer)
        if self._request is None or self._request[0] != key:
            template = get_sources_request(
                0, self._agent, wants, domain=self.config.domain, offer=offer
            )
            self._request = (key, template)
        request = pb.GetSourcesRequest()
        request.CopyFrom(self._request[1])
        request.version = version
        request.lost.extend(s for s in lost if s)
        self._name_known_keys(request)
        self._settle()
        # Waits for a held parent happen on the sidecar; NoSourceFree here means a full tree:
        # free again as soon as some pull ends.
        pause = 0.001
        while True:
            try:
                return self._client.ask(request)
            except NoSourceFree:
                if time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)
                pause = min(2 * pause, 0.2)

    def _fail(self, version: int) -> None:
        self._settle()  # a COMPLETE queued before must not land after this FAILED
        if self._offered == version:
            self._own.finish(CopyProgress.FAILED)
        self._release(version, complete=False)

    def _release(self, version: int, *, complete: bool) -> None:
        """Tell the sidecar the pull ended, without waiting: the copy's readers learn it from
        the progress word already; the next GetSources waits for it (`_settle`)."""
        self._released = self._releases.submit(self._send_release, version, complete)

    def _settle(self) -> None:
        """Wait for the release in flight (and the word write queued before it), so the sidecar
        sees this receiver's calls in order and the word its writes in order."""
        if self._released is not None:
            self._released.result()
            self._released = None

    def _complete(self, version: int, serving: bool) -> None:
        """On the release thread: the copy's word says COMPLETE, then the release goes out
        (as failed when the word could not be written)."""
        complete = True
        if serving:
            try:
                self._own.finish(CopyProgress.COMPLETE)
            except Exception:
                log.exception("version %d: marking this copy complete failed", version)
                complete = False
        self._send_release(version, complete)

    def _send_release(self, version: int, complete: bool) -> None:
        try:
            self._client.release_sources(version, self._agent, complete=complete)
        except UnknownVersion:
            log.debug("version %d left the sidecar's tree before its release", version)
        except Exception as e:  # the sidecar forgets the pull at the TTL anyway
            log.warning("releasing the sources of version %d failed: %s", version, e)

    def close(self) -> None:
        """Stop serving: readers of this copy see it withdrawn."""
        self.abandon()
        self._settle()
        if self._offered is not None:
            self._own.finish(CopyProgress.FAILED)
            self._release(self._offered, complete=False)
            self._offered = None
        self._settle()
        self._releases.shutdown(wait=True)
        self._control.release()
        self._transport.deregister(self._own.region)
        self._own.close()


def _fall_back_or_fail(error: SourceLost, deadline: float) -> None:
    """After a run lost a source: return to ask for another one, or raise TreePullError when
    the pull cannot go on (a failed peer whose bytes this copy forwarded already, or a pull
    past its deadline)."""
    if isinstance(error, SourceFailed):
        if error.exposed:
            raise TreePullError(
                f"{error}; this copy had forwarded some of its bytes, so it fails too"
            ) from error
    elif time.monotonic() > deadline:
        raise TreePullError(str(error)) from error


def _verified(check: RunningCheck, filled: Filled, trace: PullTrace | None) -> int:
    """The shards the running check verified, once every byte is in (TreePullError naming
    where the copy was read from on a mismatch)."""
    try:
        verified = check.finish()
    except ChecksumMismatch as e:
        read_from = sorted(filled.bytes_by_source())
        raise TreePullError(f"{e} (this copy was read from {read_from})") from e
    if trace is not None:
        trace.add(TraceEvent.VERIFIED, value=verified)
    return verified


def _checking(
    check: RunningCheck | None,
    on_progress: Callable[[int, int], None] | None,
    trace: PullTrace | None = None,
) -> Callable[[int, int], None] | None:
    """The pull's progress callback: starts the check of what landed, then tells the caller."""
    if check is None:
        return on_progress

    def progress(prefix: int, total: int) -> None:
        if trace is not None:
            trace.add(TraceEvent.CHECK_TOLD, value=prefix)
        check.advance(prefix)
        if trace is not None:
            trace.add(TraceEvent.CHECK_STARTED, value=prefix)
        if on_progress is not None:
            on_progress(prefix, total)

    return progress
