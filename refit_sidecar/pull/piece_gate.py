"""Reading behind a trainer rank's snapshot copy (docs/refit.md, "Reading behind the snapshot
copy").

A rank copies a version into its slot in pieces, in slot order on one stream, and writes each
piece's word behind the piece's bytes (`AgentRecord.pieces`). A receiver that leased the
version before it was readable need not wait for the last word: `PieceGate` tells its pull
which READ requests may be posted, those whose bytes lie in pieces whose words name the
version, and reads the words of the sources it still waits on (one small one-sided read per
source at a time, posted again as soon as it lands) while the pull polls its requests. The
first request then waits for the first piece only, not for the whole copy.

As with the version words alone (`version_words`), a word naming a newer version means the
lease did not hold (`SourceLost`), words that do not name the version by the deadline fail the
pull (`WordTimeout`), and nothing here trusts the bytes: the checksums the ranks report are
compared once they landed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from refit_sidecar.core.manifest import AgentRecord, SnapshotPieces
from refit_sidecar.pull.nixl_transport import NixlTransport, Posted
from refit_sidecar.pull.transport import SourceLost
from refit_sidecar.pull.version_words import VersionWords, WordTimeout

FIRST_LOOK_S = 0.005
"""How long `PieceGate.first_look` checks the first reads of the words back to back: a few
round trips of a small read, then the pull's loop polls them between pauses."""


class PieceGate:
    """One pull's gate on the pieces of the version `version` of every source in `agents`
    (each with `pieces`), read into `words`' memory; `deadline` (time.monotonic()) bounds the
    wait for the words."""

    def __init__(
        self,
        transport: NixlTransport,
        words: VersionWords,
        agents: Mapping[str, AgentRecord],
        version: int,
        deadline: float,
        *,
        readable: Callable[[], bool] | None = None,
    ) -> None:
        """`readable()`: whether the sidecar has said the version is readable (every rank's
        copy landed): the gate then opens without a look, or without waiting for the look in
        flight, whichever is first."""
        if not agents or any(a.pieces is None for a in agents.values()):
            raise ValueError("every source needs its snapshot's pieces")
        self._transport = transport
        self._words = words
        self._agents = dict(agents)
        self._version = version
        self._deadline = deadline
        self._readable = readable
        self._pieces: dict[str, SnapshotPieces] = {}
        self._offsets: dict[str, int] = {}
        at = 0
        for name, agent in self._agents.items():
            assert agent.pieces is not None
            self._pieces[name] = agent.pieces
            self._offsets[name] = at
            at += agent.pieces.words.nbytes
        words.memory(at)
        self._landed = dict.fromkeys(self._agents, 0)
        """Per source: how many of its pieces, from the first, hold the version."""
        self._reading: dict[str, Posted] = {}
        self.rounds = 0
        """Reads of the words that landed."""
        self.told: float | None = None
        """When the gate opened on the sidecar's word, not on a look (time.perf_counter());
        None if it did not (`Gate.told`)."""
        self.first_seen: tuple[float, int] | None = None
        """When the first read of words landed (time.perf_counter()) and how many pieces,
        over every source, held the version then (`Gate.first_seen`)."""

    @classmethod
    def applies(cls, agents: Iterable[AgentRecord]) -> bool:
        """Whether every source copies its snapshot in pieces with words (others are waited
        for on their version word or on the sidecar)."""
        agents = list(agents)
        return bool(agents) and all(a.pieces is not None for a in agents)

    def need(self, agent: str, end: int) -> int:
        """The last piece a READ request of `agent` reading up to address `end` (one past its
        last byte) reads from; ValueError when it reads outside the slot."""
        return self._pieces[agent].piece_of(end)

    def ready(self, agent: str, need: int) -> bool:
        """Whether every piece of `agent` up to `need` holds the version (pieces land in
        order: a word naming it says every piece before it landed too)."""
        return need < self._landed[agent]

    @property
    def open(self) -> bool:
        """Every piece of every source holds the version."""
        return all(n == len(self._pieces[a].ends) for a, n in self._landed.items())

    def poll(self, waiting: Iterable[str]) -> None:
        """Advances the reads of the words of the sources in `waiting` (those with requests
        held back): takes the words of a read that landed, posts the next. SourceLost when a
        source cannot be read or names a newer version; WordTimeout when a read that landed
        past the deadline still finds pieces missing (a deadline past already at the first
        read still reads the words once)."""
        if self._sidecar_says():
            return
        check = self._transport.check
        for name in waiting:
            reading = self._reading.get(name)
            if reading is not None:
                if not check(reading):
                    continue
                del self._reading[name]
                self._take(name)
                count = len(self._pieces[name].ends)
                if self._landed[name] < count and time.monotonic() > self._deadline:
                    raise WordTimeout(
                        f"the snapshot pieces of {name} did not hold version {self._version} "
                        "in time (the trainer's step failed, or the rank is gone)"
                    )
            if self._landed[name] < len(self._pieces[name].ends):
                self._reading[name] = self._words.post(
                    self._agents[name], self._pieces[name].words, self._offsets[name]
                )

    def first_look(self) -> None:
        """Waits for the reads the first `poll` posted, checking them back to back as the
        version words' wait does, for at most `FIRST_LOOK_S`, and takes their words. The
        pull's loop checks later reads between pauses: checked back to back, many rounds
        left the cores of a busy CPU host to spinning receivers. SourceLost as `poll`."""
        check = self._transport.check
        give_up = time.monotonic() + FIRST_LOOK_S
        for name, reading in list(self._reading.items()):
            while not check(reading):
                if time.monotonic() > give_up or self._sidecar_says():
                    return
            del self._reading[name]
            self._take(name)

    def _sidecar_says(self) -> bool:
        """Opens the gate when the sidecar has said the version is readable (True then)."""
        if self.told is not None:
            return True
        if self._readable is None or self.open or not self._readable():
            return False
        self._landed = {name: len(pieces.ends) for name, pieces in self._pieces.items()}
        self.told = time.perf_counter()
        return True

    def _take(self, name: str) -> None:
        self.rounds += 1
        count = len(self._pieces[name].ends)
        seen = self._words.values(self._offsets[name], count)
        if int(seen.max()) > self._version:
            raise SourceLost(
                f"{name}: its slot holds a piece of version {int(seen.max())}, not "
                f"{self._version}: the lease on it did not hold",
                agent=name,
            )
        holds = seen == self._version
        self._landed[name] = count if holds.all() else int(np.argmin(holds))
        if self.first_seen is None:
            self.first_seen = (time.perf_counter(), sum(self._landed.values()))

    def settle(self) -> None:
        """Waits for the reads of words still in flight (their memory is read again by the
        next pull), ignoring their errors."""
        for posted in self._reading.values():
            deadline = time.monotonic() + 1.0
            try:
                while not self._transport.check(posted) and time.monotonic() < deadline:
                    time.sleep(1e-5)
            except SourceLost:
                pass
        self._reading.clear()
