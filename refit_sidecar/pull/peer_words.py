"""How a pipelined pull follows its peers' copies: each peer's gate (its progress word, and
the first byte of its copy the word counts from), and the registered slots this receiver
reads the words into, with the peers' mirrors of their words in files on this host.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from refit_sidecar.core.manifest import ShardLocation
from refit_sidecar.core.shared_word_ref import ProgressFileRef
from refit_sidecar.memory.region import Region
from refit_sidecar.pull.nixl_transport import NixlTransport
from refit_sidecar.pull.progress import PROGRESS_BYTES, HostWords, Words
from refit_sidecar.pull.shared_word import ProgressFileReader

SLOT_BYTES = 64
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
        if self.region is not None and self.region.nbytes >= slots * SLOT_BYTES:
            return self.region
        self._release_region()
        self._memory = self._make(max(slots, 8) * SLOT_BYTES)
        self.region = self._memory.region
        self._transport.register(self.region)
        return self.region

    def word(self, slot: int) -> np.ndarray:
        assert self._memory is not None
        return self._memory.read(slot * SLOT_BYTES, PROGRESS_BYTES)

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
