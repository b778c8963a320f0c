"""Rank 0's book of each weights version's publication: what FinishTrainStep answers and
GetStatus lists, so no answer calls a version published that never becomes readable.

Rank 0's reporter thread writes it (its own report, then the wait for every rank's); the
servicer reads it from the event loop's threads. A version ends READABLE or FAILED; a FAILED
one that the sidecar may still hold half-reported is handed to the next reservation to
abandon (`take_abandoned`), so its slot is freed and receivers waiting on it move on.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from trainer_svc.domain import Publication, PublicationState

KEPT = 8
"""Versions the book remembers (GetStatus lists them)."""


class PublicationBook:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._entries: OrderedDict[int, Publication] = OrderedDict()
        self._abandoned: set[int] = set()

    def _set(self, version: int, state: PublicationState, reason: str = "") -> None:
        with self._changed:
            self._entries[version] = Publication(
                weights_version=version, state=state, reason=reason
            )
            self._entries.move_to_end(version)
            while len(self._entries) > KEPT:
                self._entries.popitem(last=False)
            self._changed.notify_all()

    def pending(self, version: int) -> None:
        self._set(version, PublicationState.PENDING)

    def not_published(self, version: int) -> None:
        self._set(version, PublicationState.NOT_PUBLISHED)

    def retrying(self, version: int, reason: str) -> None:
        self._set(version, PublicationState.RETRYING, reason)

    def readable(self, version: int) -> None:
        self._set(version, PublicationState.READABLE)

    def failed(self, version: int, reason: str) -> None:
        """`version` will never be readable; the next reservation abandons it."""
        with self._changed:
            self._abandoned.add(version)
            self._set(version, PublicationState.FAILED, reason)

    def take_abandoned(self) -> tuple[int, ...]:
        """The failed versions not yet handed to a reservation (it retires them)."""
        with self._changed:
            taken = tuple(sorted(self._abandoned))
            self._abandoned.clear()
            return taken

    def give_back(self, versions: tuple[int, ...]) -> None:
        """A reservation that carried `versions` failed: the next one carries them again."""
        with self._changed:
            self._abandoned.update(versions)

    def get(self, version: int) -> Publication | None:
        with self._changed:
            return self._entries.get(version)

    def recent(self) -> list[Publication]:
        """The remembered versions, oldest first."""
        with self._changed:
            return list(self._entries.values())

    def wait(self, version: int, timeout: float) -> Publication | None:
        """`version`'s entry once it is settled (READABLE, FAILED, NOT_PUBLISHED), or as it
        stands after `timeout` seconds; None for a version the book does not know."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                entry = self._entries.get(version)
                left = deadline - time.monotonic()
                if entry is None or entry.state.settled or left <= 0:
                    return entry
                self._changed.wait(left)
