"""The seam that moves a PullPlan's bytes into a caller's buffer.

`Transport.pull(plan, dest)` reads every `ShardReads` of the plan into `dest` (a `Region` at
least `plan.nbytes` long) and returns `PullStats`; it raises `SourceLost` when a source cannot
deliver (dead, disconnected, stalled past a deadline, memory not registered): a pull either
fills all of its targets or fails. `InMemoryTransport` is the reference implementation (numpy
copies within one process, from buffers registered per agent name, like NIXL's registered
memory); `nixl_transport.NixlTransport` is the real one. A pull over NIXL may take checksums
that come after it started (`LaterChecksums`) and a gate on its requests (`Gate`).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from refit_sidecar.core.plan import Checksums, PullPlan
from refit_sidecar.integrity.partial_sums import PartialSums
from refit_sidecar.integrity.verify import check_pulled
from refit_sidecar.memory.region import Region, host_view
from refit_sidecar.pull.trace import Event


class SourceLost(RuntimeError):
    """A source could not deliver its bytes; nothing pulled in the same call may be used."""

    def __init__(self, message: str, *, agent: str | None = None) -> None:
        super().__init__(message)
        self.agent = agent
        """The source agent at fault, when known."""


@dataclass(frozen=True)
class PullStats:
    nbytes: int
    seconds: float
    reads: int
    """Descriptors (byte ranges) read."""
    transfers: int
    """Transfer requests posted (over NIXL: per source agent and memory type, one per
    `NixlConfig.request_bytes` or so)."""
    reposted: int = 0
    """Of those, requests prepared by an earlier pull and posted again."""
    verified_shards: int = 0
    lag_s: float = 0.0
    """Seconds from the last byte landed until the pull's listener had heard of every prefix
    (a running check's parts started, what they hand on queued)."""
    checksums_wait_s: float = 0.0
    """Then seconds waiting for checksums published after the pull started."""
    check_s: float = 0.0
    """Then seconds to the checksums compared (the last parts' sums, the comparison)."""
    gated_s: float = 0.0
    """Seconds from the pull's start until its first request was posted, when its requests
    waited for the pieces of the sources' snapshot copies (`piece_gate`); 0 otherwise."""
    gate_first_s: float = 0.0
    """With such a gate: seconds from the pull's start until its first look at the sources'
    pieces landed (a small read of their words)."""
    gate_first_pieces: int = 0
    """The pieces, over every source, that held the version at that first look: none means
    the first request waited for the sources' copies, some means for the pull's own work."""
    gate_rounds: int = 0
    """Looks at the sources' pieces during the pull."""
    trace: tuple[Event, ...] = ()
    """The pull's timeline, when asked for (`trace.PullTrace`)."""
    partial_sums: PartialSums | None = None
    """When verifying: the WSUM-64s of the reads of parts of shards, which the engine's
    workers check together (`partial_sums`)."""

    @property
    def gib_per_s(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9) / 2**30


class Transport(Protocol):
    def pull(self, plan: PullPlan, dest: Region, *, verify: bool = False) -> PullStats:
        """Fill `dest` per `plan`; with `verify`, check the checksums of shards read whole."""
        ...


class InMemoryTransport:
    """Reference transport: sources are numpy buffers in this process, keyed by agent name."""

    def __init__(self, buffers: Mapping[str, Sequence[np.ndarray]]) -> None:
        self._buffers = {
            agent: sorted(
                ((b.ctypes.data, b.reshape(-1).view(np.uint8)) for b in arrays),
                key=lambda entry: entry[0],
            )
            for agent, arrays in buffers.items()
        }

    def pull(self, plan: PullPlan, dest: Region, *, verify: bool = False) -> PullStats:
        if dest.nbytes < plan.nbytes:
            raise ValueError(f"destination holds {dest.nbytes} bytes, the plan needs {plan.nbytes}")
        out = host_view(dest)
        start = time.perf_counter()
        for reads in plan.reads:
            src, base = self._resolve(reads.location.agent, reads.location.address)
            for off, n, at in zip(
                reads.shard_offsets, reads.lengths, reads.dest_offsets, strict=True
            ):
                lo = base + int(off)
                if lo + n > len(src):
                    raise SourceLost(f"{reads.location.agent}: read past a registered buffer")
                out[at : at + n] = src[lo : lo + n]
        stats = PullStats(
            plan.bytes_read, time.perf_counter() - start, plan.num_reads, len(plan.agents)
        )
        if not verify:
            return stats
        verified, partial = check_pulled(plan, dest)
        return replace(stats, verified_shards=verified, partial_sums=partial)

    def _resolve(self, agent: str, address: int) -> tuple[np.ndarray, int]:
        buffers = self._buffers.get(agent)
        if not buffers:
            raise SourceLost(f"no source agent {agent!r}")
        i = bisect.bisect_right([a for a, _ in buffers], address) - 1
        if i < 0 or address >= buffers[i][0] + len(buffers[i][1]):
            raise SourceLost(f"{agent}: address {address:#x} is not in registered memory")
        return buffers[i][1], address - buffers[i][0]


class LaterChecksums(Protocol):
    """A pull's checksums that come after it started (`nixl_transport.NixlTransport.pull`)."""

    def prepare(self) -> bool:
        """Converts them if they have come, never raising (an error waits for `result`);
        True once nothing is left to prepare. The pull calls it at turns where it would
        pause, while its bytes are in flight."""
        ...

    def result(self) -> Sequence[Checksums]:
        """Waits for them: each read's, in the plan's order."""
        ...


class Gate(Protocol):
    """Which READ requests of a pull may be posted yet (`piece_gate.PieceGate`)."""

    rounds: int
    """Looks at the sources that landed (reads of their words)."""
    first_seen: tuple[float, int] | None
    """The first look's time (time.perf_counter()) and what it let go (pieces holding the
    version), None before it: with `rounds`, whether a pull's first request waited for the
    sources' copies or for its own looks (`PullStats.gate_first_s`)."""
    told: float | None
    """When the gate opened on the sidecar's word that the version is readable, before any
    look let it (time.perf_counter()); None if it did not."""

    def need(self, agent: str, end: int) -> int:
        """What a request of `agent` reading its memory up to address `end` (one past its
        last byte) waits for, in terms `ready` understands."""
        ...

    def ready(self, agent: str, need: int) -> bool: ...

    def poll(self, waiting: Iterable[str]) -> None:
        """Learn more about the sources in `waiting`, without blocking; SourceLost or a
        TimeoutError ends the pull."""
        ...

    def first_look(self) -> None:
        """After the pull's set-up: wait a moment for what the first `poll` asked, so the
        requests it lets go are posted at once."""
        ...

    def settle(self) -> None:
        """The pull ended: wait for what `poll` left in flight."""
        ...
