"""Reading the trainer ranks' version words: when a version's bytes are in its slot.

A trainer rank writes its slot's version word (`AgentRecord.version_word`, one little-endian
uint64 in registered memory) after the version's snapshot copy has landed: on a GPU it is
queued on the copy's stream, behind the copies, so no host thread sits between the last byte
and the word. A receiver that leased a version before the sidecar declared it readable
(`AcquireLease` with `before_readable`) reads each of its sources' words with one small
one-sided read until every one names the version, then reads the bytes: no control-plane
round trip lies between the trainer's step and the receiver's first read.

The lease keeps the slot from being handed to another version, so a word that names the
version stays so for the whole pull. A word naming a newer version means the lease did not
hold (the sidecar restarted and forgot it): the pull fails (`SourceLost`) rather than read
bytes of the wrong version. Nothing here trusts the bytes: they are checked against the
checksums the ranks report (GetChecksums) once they arrive.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from refit_sidecar.core.manifest import VERSION_WORD_BYTES, AgentRecord, ShardLocation
from refit_sidecar.memory.region import Region
from refit_sidecar.pull.nixl_transport import NixlTransport, Posted
from refit_sidecar.pull.progress import HostWords, Words
from refit_sidecar.pull.transport import SourceLost

DEFAULT_POLL_S = 50e-6
"""Pause between two rounds of reads: the snapshot copy the words wait for takes a
millisecond or two, a read of a word tens of microseconds."""


class WordTimeout(TimeoutError):
    """A source's word did not name the version in time (its step failed, or the rank is
    gone): nothing was read."""


class VersionWords:
    """This receiver's registered memory for the sources' words, made once by `words` (host
    memory by default; a receiver staging on a GPU reads into device memory, over the same
    path as the data) and grown as sources are added."""

    def __init__(
        self,
        transport: NixlTransport,
        words: Callable[[int], Words] = HostWords,
        *,
        poll_s: float = DEFAULT_POLL_S,
    ) -> None:
        if poll_s < 0:
            raise ValueError(f"poll_s must be >= 0, got {poll_s}")
        self._transport = transport
        self._make = words
        self._poll_s = poll_s
        self._memory: Words | None = None
        self._region: Region | None = None

    @staticmethod
    def readable_by_words(agents: Sequence[AgentRecord]) -> bool:
        """Whether every source publishes a version word (trainers without one are waited for
        on the sidecar instead)."""
        return bool(agents) and all(a.version_word is not None for a in agents)

    def wait(self, agents: Sequence[AgentRecord], version: int, deadline: float) -> int:
        """Returns once every agent's word names `version`, with the rounds of reads it took.
        WordTimeout at `deadline` (time.monotonic()); SourceLost when a source cannot be read
        or its word names a newer version (its slot was handed on: the lease did not hold)."""
        if not self.readable_by_words(agents):
            raise ValueError("every source needs a version word")
        waiting = list(range(len(agents)))
        rounds = 0
        while True:
            rounds += 1
            seen = self._round(agents, waiting, deadline)
            newer = [i for i in waiting if seen[i] > version]
            if newer:
                name = agents[newer[0]].name
                raise SourceLost(
                    f"{name}: its slot holds version {int(seen[newer[0]])}, not {version}: the "
                    "lease on it did not hold",
                    agent=name,
                )
            waiting = [i for i in waiting if seen[i] < version]
            if not waiting:
                return rounds
            if time.monotonic() > deadline:
                names = [agents[i].name for i in waiting]
                raise WordTimeout(
                    f"the version words of {names} did not name version {version} in time "
                    "(the trainer's step failed, or a rank is gone)"
                )
            time.sleep(self._poll_s)

    def still(self, agents: Sequence[AgentRecord], version: int, timeout_s: float = 1.0) -> bool:
        """After a pull of `version` from `agents` (each with a version word): whether every
        word still names it, read once. A rank sets its slot's words to 0 before its next copy
        into the slot changes any byte (`trainer_svc.runtime.publication`), so True means no
        byte the pull read had been overwritten. False also when a word cannot be read within
        `timeout_s`: the caller then asks the sidecar whether its lease held."""
        if not self.readable_by_words(agents):
            return False
        try:
            seen = self._round(agents, range(len(agents)), time.monotonic() + timeout_s)
        except (SourceLost, WordTimeout):
            return False
        return bool((seen == version).all())

    def _round(
        self, agents: Sequence[AgentRecord], indexes: Sequence[int], deadline: float
    ) -> np.ndarray:
        """One read of the words of `agents[i]` for each i in `indexes` (agent i's into slot
        i), checked back to back: every agent's word as read (those not read this round as
        they were), one copy back for all. WordTimeout when a read has not landed by
        `deadline` (that source is disconnected, its read dropped with it); SourceLost as
        `post`."""
        self.memory(max(len(agents), 8) * VERSION_WORD_BYTES)
        posted = [self.post(agents[i], _word(agents[i]), i * VERSION_WORD_BYTES) for i in indexes]
        for request in posted:
            while not self._transport.check(request):
                if time.monotonic() > deadline:
                    self._transport.forget(request.agent)
                    raise WordTimeout(f"{request.agent}: reading its version word timed out")
        return self.values(0, len(agents))

    def memory(self, nbytes: int) -> Region:
        """This receiver's registered memory for words, at least `nbytes` of it (what it held
        before is lost when it grows)."""
        if self._region is not None and self._region.nbytes >= nbytes:
            return self._region
        self.release()
        self._memory = self._make(nbytes)
        self._region = self._memory.region
        self._transport.register(self._region)
        return self._region

    def post(self, agent: AgentRecord, words: ShardLocation, offset: int) -> Posted:
        """Reads the agent's `words` (its memory) into this receiver's at `offset`, which
        `memory` made large enough; poll it with the transport's `check`."""
        region = self._region
        assert region is not None
        remote = np.array([[words.address, words.nbytes, words.device_id]], np.uint64)
        local = np.array([[region.address + offset, words.nbytes, region.device_id]], np.uint64)
        return self._transport.post(agent, words.mem_type, remote, local, region)

    def values(self, offset: int, count: int) -> np.ndarray:
        """`count` words read into this receiver's memory at `offset`, as uint64."""
        assert self._memory is not None
        raw = self._memory.read(offset, count * VERSION_WORD_BYTES)
        return np.ascontiguousarray(raw).view("<u8")

    def release(self) -> None:
        """Deregisters the memory (the transport's `close` does too)."""
        if self._region is not None:
            self._transport.deregister(self._region)
        self._memory = None
        self._region = None


def _word(agent: AgentRecord) -> ShardLocation:
    word = agent.version_word
    assert word is not None
    return word
