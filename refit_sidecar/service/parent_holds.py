"""A receiver's parents held across versions (`TreeConfig.hold_parents_s`): while a version is
young, each receiver that pulled an earlier one finds the parents it read from then, and their
child slots are kept for the receivers that have not asked yet, so the tree keeps its shape
from one version to the next instead of being rebuilt by whoever asks first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from refit_sidecar.core.tree_records import HeldForParent, NodeKind, TreeConfig
from refit_sidecar.service.tree_shape import OpenVersion
from trainer_refit.errors import quoted


class ParentHolds:
    """Each receiver's version, primaries and time of its latest assignment: held for it while
    a later version is young, as long as the receiver asked within `TreeConfig.peer_ttl_s` (it
    may skip versions, not stop)."""

    def __init__(
        self, config: TreeConfig, caps: Mapping[NodeKind, int], clock: Callable[[], float]
    ) -> None:
        self._config = config
        self._caps = caps
        self._clock = clock
        self._parents: dict[str, tuple[int, tuple[str, ...], float]] = {}

    def note(self, receiver_id: str, version: int, primaries: tuple[str, ...]) -> None:
        """`receiver_id` was assigned `primaries` for `version` now."""
        self._parents[receiver_id] = (version, primaries, self._clock())

    def recent(self, receiver_id: str) -> bool:
        """`receiver_id` was assigned a version within `peer_ttl_s`."""
        entry = self._parents.get(receiver_id)
        return entry is not None and self._clock() - entry[2] < self._config.peer_ttl_s

    def forget_stopped(self) -> None:
        """Forget the receivers that stopped pulling (none for `peer_ttl_s`)."""
        for receiver in [r for r in self._parents if not self.recent(r)]:
            del self._parents[receiver]

    def drop(self, source_id: str) -> None:
        """`source_id` died: its own parents and every hold naming it go."""
        self._parents.pop(source_id, None)
        for receiver, (_, parents, _) in list(self._parents.items()):
            if source_id in parents:
                del self._parents[receiver]

    def held(
        self,
        v: OpenVersion,
        receiver_id: str,
        excluded: set[str],
        versions: Iterable[OpenVersion],
    ) -> tuple[tuple[str, ...], dict[str, int]]:
        """While `v` is young: the receiver's previous parents (HeldForParent while one of
        them, alive, has not asked for `v` yet), and the child slots held for the other
        receivers that have not asked yet, by parent. `versions`: every open version (a
        parent serving one is alive)."""
        hold_s = self._config.hold_parents_s
        if self._clock() - v.opened_at >= hold_s:
            return (), {}
        before, mine, _ = self._parents.get(receiver_id, (-1, (), 0.0))
        if before >= v.version or not self.recent(receiver_id):
            mine = ()  # assigned for this version already (a fallback), or it had stopped
        late = [
            p
            for p in mine
            if p not in v.sources
            and p not in excluded
            and p not in v.gone
            and (self.recent(p) or any(p in w.sources for w in versions))
        ]
        if late:
            raise HeldForParent(
                f"version {v.version}: {quoted(receiver_id)} waits for its previous parent "
                f"{quoted(late[0])}, which has not asked for this version yet",
                v.opened_at + hold_s,
            )
        reserved: dict[str, int] = {}
        for other, (then, parents, _) in self._parents.items():
            if (
                other != receiver_id
                and then < v.version
                and other not in v.pulls
                and other not in v.gone
                and self.recent(other)
            ):
                for p in parents:
                    reserved[p] = reserved.get(p, 0) + 1
        # Holds can claim more of a parent than it has: a receiver that finished early frees
        # its slot, another takes it, and both remember that parent. This receiver is one of
        # the claimants: it asked first, so one slot is its own.
        for p in mine:
            source = v.sources.get(p)
            if source is not None and p in reserved:
                reserved[p] = min(reserved[p], self._caps[source.kind] - 1)
        return mine, reserved
