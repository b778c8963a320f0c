"""A direct receiver's pull of a version leased before it was readable (docs/refit.md, "Reading
before the report").

`Receiver.expect` asks for the next version's lease with `before_readable`: the sidecar grants
it as soon as the version's slot is reserved, with the manifest key that slot's versions have,
and says `pending`. When the fetch comes, the receiver replays the plan it holds for that key,
reads each source's version word until every one names the version (the rank writes it behind
its snapshot copy), and reads the bytes: the trainer's reports, the sidecar's answer and its
way back are off the path. Sources that copy their snapshots in pieces, each with a word, are
read behind the copy instead: each request of the pull waits for the pieces it reads
(`refit_sidecar.pull.piece_gate`), the first for the first piece only. The checksums the ranks
report are asked for at once (GetChecksums, left in flight), converted on the pull's own
thread while its bytes are in flight (`NixlTransport.pull`), and compared when the bytes have
landed; a version whose checksums never come (a rank died after its copy) is never installed,
and one whose manifest key is not the one the lease promised fails the refit.

A source without a version word (a trainer that publishes none) is waited for on the sidecar
instead: the pull starts once GetChecksums answers, that is once the version is readable.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from refit_sidecar.core.manifest import AgentRecord
from refit_sidecar.core.plan import Checksums, PullPlan
from refit_sidecar.pull.nixl_transport import NixlTransport
from refit_sidecar.pull.piece_gate import PieceGate
from refit_sidecar.pull.progress import HostWords, Words
from refit_sidecar.pull.transport import LaterChecksums
from refit_sidecar.pull.version_words import VersionWords
from refit_sidecar.service.client import Lease, SidecarClient, VersionChecksums
from refit_sidecar.service.pending import Pending


class ManifestChanged(RuntimeError):
    """The version's manifest is not the one its early lease promised: nothing installs."""


@dataclass(frozen=True)
class EarlyPull:
    """What a pull of a version leased before it was readable needs beyond its plan."""

    plan: PullPlan
    """The replayed plan, for the lease's version (its checksums only say which reads are
    checked: they are an earlier version's)."""
    checksums: LaterChecksums | None
    """When verifying: the version's checksums, each read's."""
    asked: Pending[VersionChecksums] | None = None
    """The version's GetChecksums in flight (to cancel when the pull fails)."""
    gate: PieceGate | None = None
    """When the sources copy their snapshots in pieces: the pull's requests wait for their
    pieces (the version words were not waited for)."""


_POSITIONS_KEPT = 16
"""Plans whose reads' places in the manifest's checksums are kept (a few slots' worth)."""


class BeforeReadable:
    """Reads versions leased before they were readable, for one receiver."""

    def __init__(
        self,
        client: SidecarClient,
        transport: NixlTransport,
        words: Callable[[int], Words] = HostWords,
    ) -> None:
        self._client = client
        self._transport = transport
        self._words = VersionWords(transport, words)
        self._positions: OrderedDict[int, tuple[PullPlan, list[int]]] = OrderedDict()
        """Per plan (by identity; the plan is kept so its id is not reused): where each read's
        checksums lie in the manifest's flat list."""

    def start(
        self,
        lease: Lease,
        plan: PullPlan,
        order: Sequence[tuple[str, int]],
        *,
        verify: bool,
        deadline: float,
        asked: Pending[VersionChecksums] | None = None,
        behind_copy: bool = True,
    ) -> EarlyPull:
        """Waits until the lease's version can be read (its sources' words name it, or the
        sidecar says it is readable), or, with `behind_copy` when every source copies its
        snapshot in pieces, returns at once with the gate its pull waits on. `plan`: the plan
        held for the lease's manifest key; `order`: that manifest's (parameter, shards) order;
        `asked`: the version's GetChecksums in flight, if asked already when verifying (this
        call owns it). WordTimeout or UnknownVersion at `deadline` (time.monotonic())."""
        version = lease.version
        pull = replace(plan, version=version)
        agents = _agents(pull)
        by_words = VersionWords.readable_by_words(agents)
        if asked is None and (verify or not by_words):
            wait = max(deadline - time.monotonic(), 0.0)
            asked = self._client.checksums_later(version, wait_s=wait)
        gate = None
        if behind_copy and PieceGate.applies(agents):
            named = {a.name: a for a in agents}
            gate = PieceGate(
                self._transport,
                self._words,
                named,
                version,
                deadline,
                readable=None if asked is None else asked.answered,  # answered once readable
            )
            # The first look at the sources' pieces goes out now: it lands while the rest of
            # the refit's set-up runs, and the pull's first requests need not wait for it.
            gate.poll(named)
        try:
            if gate is None and by_words:
                self._words.wait(agents, version, deadline)
            elif gate is None:
                assert asked is not None
                asked.result()  # answered once the version is readable
        except BaseException:
            if asked is not None:
                asked.cancel()
            raise
        if not verify:
            return EarlyPull(pull, None, asked, gate)
        assert asked is not None
        pending = asked
        positions = self._positions_of(plan, order)

        def checksums() -> list[Checksums]:
            got = pending.result()
            if got.manifest_key != lease.manifest_key:
                raise ManifestChanged(
                    f"version {version}'s manifest is not the one its lease named (the "
                    "trainer changed its slots' layout); nothing installs"
                )
            if len(got.checksums) != sum(n for _, n in order):
                raise ManifestChanged(f"version {version} has another number of shards")
            flat = got.checksums
            return [flat[i] for i in positions]

        return EarlyPull(pull, _Later(asked, checksums), asked, gate)

    def unchanged(self, plan: PullPlan) -> bool:
        """After a direct pull of `plan` (any, leased early or not): whether every source's
        version word still names the plan's version (`VersionWords.still`): no byte the pull
        read was overwritten, so its lease need not be confirmed at the sidecar."""
        return self._words.still(_agents(plan), plan.version)

    def _positions_of(self, plan: PullPlan, order: Sequence[tuple[str, int]]) -> list[int]:
        kept = self._positions.get(id(plan))
        if kept is not None and kept[0] is plan:
            self._positions.move_to_end(id(plan))
            return kept[1]
        first: dict[str, int] = {}
        at = 0
        for name, count in order:
            first[name] = at
            at += count
        positions = [first[r.parameter] + r.shard for r in plan.reads]
        self._positions[id(plan)] = (plan, positions)
        while len(self._positions) > _POSITIONS_KEPT:
            self._positions.popitem(last=False)
        return positions

    def release(self) -> None:
        self._words.release()


class _Later:
    """`LaterChecksums` of a GetChecksums in flight: `pick` converts its answer into each
    read's (a record per shard: a share of a refit's tail when taken after the last byte, so
    the pull prepares it while its bytes are in flight)."""

    def __init__(self, asked: Pending[VersionChecksums], pick: Callable[[], list[Checksums]]):
        self._asked = asked
        self._pick = pick
        self._outcome: tuple[list[Checksums], None] | tuple[None, Exception] | None = None

    def prepare(self) -> bool:
        if self._outcome is None:
            if not self._asked.done():
                return False
            self._settle()
        return True

    def result(self) -> Sequence[Checksums]:
        if self._outcome is None:
            self._settle()
        assert self._outcome is not None
        value, error = self._outcome
        if error is not None:
            raise error
        assert value is not None
        return value

    def _settle(self) -> None:
        try:
            self._outcome = (self._pick(), None)
        except Exception as e:  # raised by `result`, on the pull's path
            self._outcome = (None, e)


def _agents(plan: PullPlan) -> list[AgentRecord]:
    """The agents the plan reads from, in the order of its reads."""
    names = dict.fromkeys(r.location.agent for r in plan.reads)
    return [plan.agents[name] for name in names]
