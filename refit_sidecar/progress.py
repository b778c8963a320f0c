"""A serving receiver's progress word: how far its copy of a version is filled, readable by its
children with one small one-sided read (pipelined fan-out, docs/fanout.md).

Three little-endian uint64 in registered host memory:

- word 0: the version being filled (or served);
- word 1: `tag | filled`, the bytes of the copy filled in order from its first byte;
- word 2: `tag | state` (`CopyProgress`),

where `tag` is the version's low 24 bits shifted above bit 40, so a word read alongside a word
of another version (a read racing a write: NIXL's reads are not atomic over 24 bytes) is seen
as torn and read again. The writer keeps this order when a new version starts: filled 0 and
state FILLING under the new tag, then word 0. A reader therefore never sees the new version
with the old version's fill.

A child reads chunk k of its parent's copy once `filled` covers it, and counts the chunk as
valid only after a later read of the word still shows the same version in a state other than
FAILED (the parent cannot have started overwriting it before that); it installs nothing until
the word says COMPLETE (the parent verified its copy).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from refit_sidecar.manifest import MemType, ShardLocation, c_strides
from refit_sidecar.transport import Region

PROGRESS_BYTES = 24
_FILLED_BITS = 40
_FILLED_MASK = (1 << _FILLED_BITS) - 1
_TAG_MASK = (1 << 24) - 1


class CopyProgress(enum.IntEnum):
    FILLING = 0
    COMPLETE = 1
    """Every byte present and verified."""
    FAILED = 2
    """The copy failed, or was withdrawn: nothing read from it may be used."""


class TornRead(ValueError):
    """The three words belong to different versions: read again."""


@dataclass(frozen=True)
class ProgressWord:
    version: int
    filled: int
    """Bytes filled in order from the copy's first byte."""
    state: CopyProgress

    @staticmethod
    def decode(raw: np.ndarray) -> ProgressWord:
        words = [int(w) for w in np.asarray(raw).reshape(-1).view("<u8")[:3]]
        version, filled_word, state_word = words
        tag = version & _TAG_MASK
        if filled_word >> _FILLED_BITS != tag or state_word >> _FILLED_BITS != tag:
            raise TornRead(f"progress words of different versions: {words}")
        try:
            state = CopyProgress(state_word & _FILLED_MASK)
        except ValueError:
            raise TornRead(f"unknown copy state in {words}") from None
        return ProgressWord(version, filled_word & _FILLED_MASK, state)


class OwnProgress:
    """This receiver's progress word, in host memory it registers with its NIXL agent."""

    def __init__(self, agent: str) -> None:
        self._words = np.zeros(3, dtype="<u8")
        self._agent = agent
        self.region = Region.of_array(self._words)
        self.version = 0

    @property
    def location(self) -> ShardLocation:
        """Where children read the word (for `sources.Offer.progress`)."""
        return ShardLocation(
            agent=self._agent,
            address=self.region.address,
            nbytes=PROGRESS_BYTES,
            shape=(PROGRESS_BYTES,),
            strides=c_strides((PROGRESS_BYTES,)),
            mem_type=MemType.DRAM,
        )

    def start(self, version: int) -> None:
        """Begin filling `version`: nothing filled; readers of the previous version see their
        copy gone (the version word changes last, after the fill is reset)."""
        if version >= 1 << 63:
            raise ValueError(f"version {version} does not fit a progress word")
        tag = (version & _TAG_MASK) << _FILLED_BITS
        self._words[1] = tag
        self._words[2] = tag | CopyProgress.FILLING
        self._words[0] = version
        self.version = version

    def filled(self, nbytes: int) -> None:
        if not 0 <= nbytes <= _FILLED_MASK:
            raise ValueError(f"{nbytes} bytes do not fit a progress word")
        self._words[1] = ((self.version & _TAG_MASK) << _FILLED_BITS) | nbytes

    def finish(self, state: CopyProgress) -> None:
        self._words[2] = ((self.version & _TAG_MASK) << _FILLED_BITS) | state

    def read(self) -> ProgressWord:
        return ProgressWord.decode(self._words)
