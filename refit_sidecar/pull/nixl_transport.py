"""`Transport` over NIXL: one agent per puller, one-sided READs from the sources' memory.

NIXL 1.5.1 behaviour this relies on (checked on the CPU machine, UCX over DRAM):
- The UCX backend runs with `ucx_error_handling_mode=peer`: a source that dies before or during
  a pull makes `transfer`/`check_xfer_state` raise `nixlRemoteDisconnectError`, not hang.
- Over shared memory a READ completes inside `transfer()` (the puller copies); over TCP it needs
  the source's progress thread, so a stalled source stalls the pull: the deadline catches that.
- `fetch_remote_metadata` needs the puller's own listener thread (port 0 works), is asynchronous
  and fails silently (connection refused is only logged): it is repeated until
  `check_remote_metadata` says the source's memory is known. That listener binds every
  interface (NIXL takes no address) and hands this agent's metadata, and with it the
  descriptors of its registered destinations, to whoever asks: it runs only when
  `NixlConfig.metadata_listener` is set. Sources published through the sidecar carry their
  metadata in the manifest and need none.
Lists of `prep_threshold` or more descriptors are prepped; requests are cached per (agent,
destination, descriptors), so a refit of an unchanged layout re-posts ready requests.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

from refit_sidecar.core.manifest import AgentRecord, MemType
from refit_sidecar.core.network import NixlNetwork, ProgressPoller, create_ucx_backend
from refit_sidecar.core.plan import PullPlan
from refit_sidecar.memory.region import Region
from refit_sidecar.pull.announcer import ProgressPublisher
from refit_sidecar.pull.chunking import requests_of
from refit_sidecar.pull.pending_pull import (
    LONGEST_PAUSE_S,
    NIXL_ERRORS,
    PendingPull,
    Xfer,
    release_xfer,
    traced,
)
from refit_sidecar.pull.running_check import RunningCheck
from refit_sidecar.pull.trace import PullTrace, TraceEvent
from refit_sidecar.pull.transport import Gate, LaterChecksums, PullStats, SourceLost


@dataclass(frozen=True, kw_only=True)
class NixlConfig:
    name: str
    """NIXL agent name of this puller; unique among sources and pullers."""
    connect_timeout_s: float = 30.0
    """How long to retry fetching a source's metadata from its listener."""
    pull_timeout_s: float = 600.0
    """Deadline of one pull; past it the pull is aborted with SourceLost."""
    prep_threshold: int = 16
    """Descriptor count from which descriptor lists are prepped."""
    cache_size: int = 64
    """Transfer requests kept for re-posting."""
    request_bytes: int = 256 << 20
    """About how many bytes one READ request of a pull carries (`chunking.groups`). Several
    requests in flight move a model faster than one request holding every read (measured:
    BENCHMARKS.md, refit_install)."""
    request_taper: int = 0
    """Halvings of `request_bytes` towards each end of a source's reads
    (`chunking.chunk_bounds`): small last requests land the pull's last bytes in small steps,
    so a running check (and what it hands on) has only a small part left after the last
    one; 0: every request about `request_bytes`."""
    requests_in_flight: int = 0
    """Requests of a pull posted at once, the next posted as one completes, in destination
    order; 0: all at once. Requests that share the link all end near the pull's end, so a
    check that runs as the destination fills in order (`RunningCheck`) finds little to do
    before it; a few at a time land in order."""
    metadata_listener: bool = False
    """Run NIXL's metadata listener, which fetching a source's metadata from the source's own
    listener needs (`AgentRecord` without a blob)."""
    host: str | None = None
    """An address of the interface this puller's UCX endpoints listen on (`NixlNetwork`); None:
    every interface."""
    net_devices: tuple[str, ...] = ()
    """RDMA ports (``mlx5_0:1``) the endpoints may use besides the interface of `host`."""
    progress_poll_s: float | None = None
    """A puller that also serves its memory to others (tree fan-out) must progress its UCX
    worker while it does not pull itself: a reader's endpoint wire-up needs it, and reads
    that are not one-sided (over TCP, say) do too. A thread does so every `progress_poll_s`
    seconds (NIXL's own progress thread yields in a tight loop and so takes a core's share:
    in a vLLM worker, from the engine). None: only while this transport pulls."""

    def __post_init__(self) -> None:
        if (
            not self.name
            or min(self.connect_timeout_s, self.pull_timeout_s) <= 0
            or self.request_bytes < 1
            or self.requests_in_flight < 0
            or not 0 <= self.request_taper < self.request_bytes.bit_length()
        ):
            raise ValueError(f"bad NIXL transport config {self}")
        if self.progress_poll_s is not None and not self.progress_poll_s > 0:
            raise ValueError(f"progress_poll_s must be positive, got {self.progress_poll_s}")
        NixlNetwork(host=self.host, extra_devices=self.net_devices)  # raises for bad values


class NixlTransport:
    def __init__(self, agent: nixl_agent, config: NixlConfig) -> None:
        self._live_agent: nixl_agent | None = agent
        self._config = config
        self._metadata: dict[str, bytes] = {}  # loaded agents: blob, or b"" when fetched
        self._dests: dict[Region, Any] = {}  # registered destinations
        self._xfers: OrderedDict[bytes, Xfer] = OrderedDict()  # LRU of ready requests
        self._cut: OrderedDict[tuple[Any, ...], tuple[Any, list[_Cut]]] = OrderedDict()
        """A pull's requests by its plan's reads (kept, so their id is not reused) and
        destination: a plan replayed for each version of a slot is cut once, not at the start
        of every pull, where cutting it (a pass over every read) came before the first
        request."""
        self._progress = (
            None
            if config.progress_poll_s is None
            else ProgressPoller(agent, config.name, config.progress_poll_s)
        )

    @property
    def _agent(self) -> nixl_agent:
        if self._live_agent is None:
            raise RuntimeError(f"NIXL transport {self._config.name!r} is closed")
        return self._live_agent

    @classmethod
    def create(cls, config: NixlConfig) -> NixlTransport:
        # No NIXL progress thread: `PendingPull.wait` progresses the worker while it polls,
        # and with `progress_poll_s` a thread of ours between pulls (the agent then takes
        # strict locks, as two threads use it).
        conf = nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=config.metadata_listener,
            listen_port=0,
            backends=[],
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
            if config.progress_poll_s is not None
            else None,
        )
        agent = nixl_agent(config.name, conf)
        create_ucx_backend(agent, NixlNetwork(host=config.host, extra_devices=config.net_devices))
        return cls(agent, config)

    def register(self, dest: Region) -> None:
        """Register a destination buffer for many pulls (registration costs, on GPUs most);
        it stays registered, and its `owner` referenced, until `deregister` or `close`. A pull
        into an unregistered buffer registers it for that pull only."""
        if dest not in self._dests:
            regions = [(dest.address, dest.nbytes, dest.device_id, "")]
            self._dests[dest] = self._agent.register_memory(regions, dest.mem_type.value)

    def metadata(self) -> bytes:
        """This agent's NIXL metadata, covering the memory registered so far: what a peer
        needs to read from it."""
        return bytes(self._agent.get_agent_metadata())

    def deregister(self, dest: Region) -> None:
        for key in [k for k, x in self._xfers.items() if x.dest == dest]:
            release_xfer(self._xfers.pop(key))
        registration = self._dests.pop(dest, None)
        if registration is not None:
            self._agent.deregister_memory(registration)

    def pull(
        self,
        plan: PullPlan,
        dest: Region,
        *,
        verify: bool = False,
        checksums_later: LaterChecksums | None = None,
        gate: Gate | None = None,
        trace: PullTrace | None = None,
    ) -> PullStats:
        """Read the plan into `dest`; with `verify`, check it against the plan's checksums,
        in device memory while the requests land (`running_check.RunningCheck`, its parts
        started from a thread of their own so that polling the requests never waits on them).
        `checksums_later`: the checksums come after the pull started (`plan`'s own then only
        say which reads are checked); they are prepared on this thread while the bytes are in
        flight, and waited for once they have landed. A receiver's threads share one
        interpreter: prepared on a thread of its own, a version's checksums took it from the
        pull's set-up, delaying the first request. `gate`: which
        requests may be posted yet (`piece_gate.PieceGate`). `trace`: records the pull's
        timeline into its stats."""
        if not verify:
            return self.start(plan, dest, gate, trace).wait()  # its stats carry the trace
        check = RunningCheck(plan, dest, taper=self._config.request_taper)
        idle = None if checksums_later is None else checksums_later.prepare
        if not check.runs_ahead:  # host memory: checked whole at the end
            stats = self.start(plan, dest, gate, trace).wait(idle=idle)
        else:
            stats = self._wait_reporting(plan, dest, check.advance, gate, trace, idle=idle)
        begin = time.perf_counter()
        final = None if checksums_later is None else checksums_later.result()
        waited = time.perf_counter()
        verified = check.finish(final)
        if trace is not None:
            trace.add(TraceEvent.VERIFIED, value=verified)
        stats = replace(
            stats,
            verified_shards=verified,
            partial_sums=check.partial,
            checksums_wait_s=waited - begin,
            check_s=time.perf_counter() - waited,
        )
        return traced(stats, trace)

    def _wait_reporting(
        self,
        plan: PullPlan,
        dest: Region,
        listener: Callable[[int], None],
        gate: Gate | None,
        trace: PullTrace | None,
        *,
        idle: Callable[[], bool] | None = None,
    ) -> PullStats:
        """Start and wait for the pull, telling `listener` of each landed prefix of device
        memory from a lane of its own (host memory: nothing until the end); `idle` as
        `PendingPull.wait`'s."""
        if dest.mem_type is MemType.DRAM:
            return self.start(plan, dest, gate, trace).wait(idle=idle)
        with ProgressPublisher(None, lambda prefix, _: listener(prefix)) as publisher:
            stats = self.start(plan, dest, gate, trace).wait(
                on_landed=lambda prefix: publisher.offer(prefix, dest.nbytes), idle=idle
            )
            landed = time.perf_counter()
        return replace(stats, lag_s=time.perf_counter() - landed)

    def start(
        self,
        plan: PullPlan,
        dest: Region,
        gate: Gate | None = None,
        trace: PullTrace | None = None,
    ) -> PendingPull:
        """Post the plan's reads: requests of about `NixlConfig.request_bytes` per source
        agent and memory type, in destination order, `NixlConfig.requests_in_flight` at a time
        (the rest as earlier ones complete, in `wait`), each once `gate` lets it; the caller
        then `wait()`s. One pull at a time per transport."""
        if dest.nbytes < plan.nbytes:
            raise ValueError(f"destination holds {dest.nbytes} bytes, the plan needs {plan.nbytes}")
        temporary = dest not in self._dests
        self.register(dest)
        begin = time.perf_counter()
        if trace is not None:
            trace.add(TraceEvent.BEGAN)
        config = self._config
        requests = self._requests_of(plan, dest)
        window = self._config.requests_in_flight or len(requests)
        pending = PendingPull(
            self,
            begin + config.pull_timeout_s,
            begin,
            temporary,
            dest,
            window,
            gate,
            LONGEST_PAUSE_S[dest.mem_type],
            trace=trace,
        )
        if gate is not None:  # the first reads of what the gate waits on, beside the set-up
            try:
                gate.poll({request.agent for request in requests})
            except (SourceLost, TimeoutError) as e:
                pending.fail(getattr(e, "agent", None) or requests[0].agent, e)
        for request in requests:
            agent = request.agent
            try:
                xfer, cached = self._xfer(
                    plan.agents[agent],
                    request.mem_type,
                    request.remote,
                    request.local,
                    dest,
                    key=request.key,
                )
                pending.spans.append((request.starts, len(pending.xfers)))
                pending.xfers.append(xfer)
                pending.reposted += cached
                need = 0 if gate is None else gate.need(agent, request.end)
                if len(pending.xfers) <= window and (gate is None or gate.ready(agent, need)):
                    pending.post(xfer)
                    if gate is not None and not pending.gated_s:
                        pending.gated_s = time.perf_counter() - begin
                else:
                    pending.queued.append((xfer, need))
            except (SourceLost, *NIXL_ERRORS) as e:  # type: ignore[misc]
                pending.fail(agent, e)
        if trace is not None:
            trace.add(TraceEvent.PREPARED, value=len(pending.xfers))
        if gate is not None and pending.queued:
            try:
                gate.first_look()
            except (SourceLost, TimeoutError) as e:
                pending.fail(getattr(e, "agent", None) or pending.queued[0][0].agent, e)
            pending._post_queued(pending.posted)  # what the first look let go
        if trace is not None and gate is not None:
            wall = time.time() - time.perf_counter()  # the gate's times are perf_counter()'s
            if gate.first_seen is not None:
                seen, pieces = gate.first_seen
                trace.add(TraceEvent.SAW, value=pieces, at=wall + seen)
            elif gate.told is not None:
                trace.add(TraceEvent.READABLE, at=wall + gate.told)
        return pending

    def _requests_of(self, plan: PullPlan, dest: Region) -> list[_Cut]:
        """The plan's requests into `dest`, in destination order (`chunking.requests_of`), cut
        once per plan and destination, with what each pull's set-up would otherwise compute
        again."""
        key = (id(plan.reads), dest.address, dest.nbytes, dest.device_id, dest.mem_type)
        kept = self._cut.get(key)
        if kept is not None and kept[0] is plan.reads:
            self._cut.move_to_end(key)
            return kept[1]
        config = self._config
        cut = requests_of(plan, dest, config.request_bytes, config.request_taper)
        cut.sort(key=lambda request: int(request[1][1][0, 0]) if len(request[1][1]) else 0)
        requests = [
            _Cut(
                agent,
                mem_type,
                remote,
                local,
                _xfer_key(agent, mem_type, remote, local, dest),
                local[:, 0].astype(np.int64) - dest.address,
                int((remote[:, 0] + remote[:, 1]).max()) if len(remote) else 0,
            )
            for (agent, mem_type), (remote, local) in cut
        ]
        self._cut[key] = (plan.reads, requests)
        while len(self._cut) > _CUTS_KEPT:
            self._cut.popitem(last=False)
        return requests

    def post(
        self,
        record: AgentRecord,
        mem_type: MemType,
        remote: np.ndarray,
        local: np.ndarray,
        dest: Region,
    ) -> Posted:
        """Post one READ request: N×3 uint64 (address, length, device) descriptors of the
        source's memory (`remote`) and of `dest`, registered already (`local`). Poll it with
        `check`. Posting the same descriptors again while the request is in flight is an
        error; SourceLost when the source cannot be reached."""
        try:
            xfer, cached = self._xfer(record, mem_type, remote, local, dest)
            xfer.done = self._agent.transfer(xfer.handle) == "DONE"
        except NIXL_ERRORS as e:
            self._forget_agent(record.name)
            raise SourceLost(f"{record.name}: {e}", agent=record.name) from e
        return Posted(xfer, prepared=not cached)

    def check(self, posted: Posted) -> bool:
        """Whether a posted request is done; SourceLost (the source is disconnected, its other
        requests dropped) when it failed."""
        xfer = posted.xfer
        if xfer.done:
            return True
        try:
            state = self._agent.check_xfer_state(xfer.handle)
        except NIXL_ERRORS as e:
            self.forget(xfer.agent)
            raise SourceLost(f"{xfer.agent}: {e}", agent=xfer.agent) from e
        if state == "ERR":
            self.forget(xfer.agent)
            raise SourceLost(f"{xfer.agent}: transfer failed", agent=xfer.agent)
        xfer.done = state == "DONE"
        return xfer.done

    def forget(self, agent: str) -> None:
        """Drop a source: its requests (cancelled when in flight) and its metadata; it is
        reconnected on next use."""
        self._forget_agent(agent)

    def _xfer(
        self,
        record: AgentRecord,
        mem_type: MemType,
        remote: np.ndarray,
        local: np.ndarray,
        dest: Region,
        *,
        key: bytes | None = None,
    ) -> tuple[Xfer, bool]:
        """The prepared request reading `remote` into `local` (of `dest`) from `record`, and
        whether it came from the cache; `key`: `_xfer_key` of them, when known."""
        if self._metadata.get(record.name) not in (None, record.metadata):
            self._forget_agent(record.name)  # a new incarnation of the source: reconnect
        if key is None:
            key = _xfer_key(record.name, mem_type, remote, local, dest)
        cached = self._xfers.get(key)
        if cached is not None:
            self._xfers.move_to_end(key)
            cached.done = False
            return cached, True
        remote_descs = self._agent.get_xfer_descs(remote, mem_type.value)
        self._ensure_metadata(record, remote_descs)
        n, nbytes = len(remote), int(remote[:, 1].sum())
        try:
            if n >= self._config.prep_threshold:
                local_h = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, dest.mem_type.value)
                remote_h = self._agent.prep_xfer_dlist(record.name, remote, mem_type.value)
                idx = np.arange(n, dtype=np.int32)
                handle = self._agent.make_prepped_xfer("READ", local_h, idx, remote_h, idx)
                xfer = Xfer(key, record.name, dest, handle, (local_h, remote_h), n, nbytes)
            else:
                local_descs = self._agent.get_xfer_descs(local, dest.mem_type.value)
                handle = self._agent.initialize_xfer("READ", local_descs, remote_descs, record.name)
                xfer = Xfer(key, record.name, dest, handle, (), n, nbytes)
        except NIXL_ERRORS as e:
            self._forget_agent(record.name)
            raise SourceLost(f"{record.name}: cannot prepare reads: {e}", agent=record.name) from e
        self._xfers[key] = xfer
        while len(self._xfers) > self._config.cache_size:
            release_xfer(self._xfers.popitem(last=False)[1])
        return xfer, False

    def _ensure_metadata(self, record: AgentRecord, remote_descs: Any) -> None:
        """Load the source's metadata (blob, or fetched from its listener) until it covers
        `remote_descs`: a source must register its memory before its metadata is useful."""
        name = record.name
        try:
            if name not in self._metadata and record.metadata:
                loaded = self._agent.add_remote_agent(record.metadata)
                if (loaded.decode() if isinstance(loaded, bytes) else loaded) != name:
                    raise SourceLost(f"metadata of agent {loaded!r} filed as {name!r}", agent=name)
                self._metadata[name] = record.metadata
            if self._agent.check_remote_metadata(name, remote_descs):
                return
            if record.metadata or record.port is None:
                raise SourceLost(
                    f"{name}: its metadata does not cover the planned memory", agent=name
                )
            if not self._config.metadata_listener:
                raise SourceLost(
                    f"{name} publishes no metadata blob, only a listener at {record.host}:"
                    f"{record.port}; fetching from it needs NixlConfig.metadata_listener",
                    agent=name,
                )
            deadline = time.monotonic() + self._config.connect_timeout_s
            while time.monotonic() < deadline:
                self._agent.fetch_remote_metadata(name, record.host, record.port)
                for _ in range(50):
                    time.sleep(0.01)
                    if self._agent.check_remote_metadata(name, remote_descs):
                        self._metadata[name] = b""
                        return
        except NIXL_ERRORS as e:
            raise SourceLost(f"{name}: metadata exchange failed: {e}", agent=name) from e
        with contextlib.suppress(*NIXL_ERRORS):
            self._agent.remove_remote_agent(name)  # whatever part of it arrived
        raise SourceLost(
            f"{name}: no metadata covering the planned memory from {record.host}:{record.port} "
            f"within {self._config.connect_timeout_s} s",
            agent=name,
        )

    def _forget_agent(self, name: str) -> None:
        for key in [k for k, x in self._xfers.items() if x.agent == name]:
            release_xfer(self._xfers.pop(key))
        if self._metadata.pop(name, None) is not None:
            with contextlib.suppress(*NIXL_ERRORS):
                self._agent.remove_remote_agent(name)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        while self._xfers:
            release_xfer(self._xfers.popitem()[1])
        for dest in list(self._dests):
            self.deregister(dest)
        for name in list(self._metadata):
            self._forget_agent(name)
        # Drop the agent with its requests released: its native teardown (UCX workers, the
        # listener) then runs on this thread, not whenever the collector reaches a transport
        # left in a reference cycle, on whatever thread that is. Later use raises.
        self._live_agent = None


@dataclass(frozen=True, eq=False)
class Posted:
    """A READ request posted with `NixlTransport.post`."""

    xfer: Xfer
    prepared: bool = False
    """The request was prepared for this post (first use of these descriptors: metadata,
    descriptor lists, the backend's handles), not reused from the cache."""

    @property
    def agent(self) -> str:
        return self.xfer.agent


@dataclass(frozen=True, eq=False)
class _Cut:
    """A READ request of a plan into a destination (`NixlTransport._requests_of`), with what
    each pull's set-up needs of it computed once: on a GPU host the set-up lies between the
    receiver's start and its first request."""

    agent: str
    mem_type: MemType
    remote: np.ndarray
    local: np.ndarray
    """N×3 uint64 descriptors (address, length, device) of the source's memory and the
    destination's."""
    key: bytes
    """Its prepared request's key in the transport's cache (`_xfer_key`)."""
    starts: np.ndarray
    """Where its reads start in the destination (int64 offsets)."""
    end: int
    """One past the last byte it reads of the source's memory (what `Gate.need` takes)."""


def _xfer_key(
    agent: str, mem_type: MemType, remote: np.ndarray, local: np.ndarray, dest: Region
) -> bytes:
    """A prepared request's key: the same descriptors of the same source and destination."""
    digest = hashlib.blake2b(remote.tobytes() + local.tobytes(), digest_size=16)
    digest.update(f"{agent}|{mem_type.value}|{dest}".encode())
    return digest.digest()


_CUTS_KEPT = 8
"""Plans whose requests a transport keeps (a few slots' worth)."""
