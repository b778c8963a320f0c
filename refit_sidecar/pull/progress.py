"""A serving receiver's progress word: how far its copy of a version is filled, readable by its
children with one small one-sided read (pipelined fan-out, docs/fanout.md).

Three little-endian uint64 in registered memory (`Words`): host memory for a copy staged in
host memory, device memory next to a copy staged on a GPU, so that children read the word over
the same one-sided path as the data (CUDA IPC, RDMA) and the serving receiver does no work for
their reads:

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from refit_sidecar.core.manifest import ShardLocation, c_strides
from refit_sidecar.memory.region import Region
from refit_sidecar.pull.shared_word import ProgressFile

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


class Words(Protocol):
    """A few bytes of memory registered for one-sided reads: progress words and the slots a
    child reads its parents' words into."""

    @property
    def region(self) -> Region: ...

    def write_words(self, words: Sequence[tuple[int, int]], *, wait: bool = True) -> None:
        """Store each (byte offset, little-endian uint64) in turn: no reader sees one before
        those listed ahead of it, nor before any word an earlier call stored. With `wait`, all
        visible once it returns (one wait for all of them); without, visible soon."""
        ...

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        """`nbytes` bytes at `offset`, as host memory."""
        ...


class HostWords:
    """`Words` in host memory (a NumPy array)."""

    def __init__(self, nbytes: int) -> None:
        self.array = np.zeros(nbytes, np.uint8)
        self._region = Region.of_array(self.array)

    @property
    def region(self) -> Region:
        return self._region

    def write_words(self, words: Sequence[tuple[int, int]], *, wait: bool = True) -> None:
        for offset, value in words:
            self.array[offset : offset + 8].view("<u8")[0] = value

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        return self.array[offset : offset + nbytes]


class OwnProgress:
    """This receiver's progress word, in `words` (host memory by default) that it registers
    with its NIXL agent. Each word is stored on its own, in the order the module docs give."""

    def __init__(
        self, agent: str, words: Words | None = None, *, mirror: ProgressFile | None = None
    ) -> None:
        """`mirror`: a file the words are stored into too, for children on this host
        (`shared_word.py`); it is closed (removed) with `close`."""
        memory = words if words is not None else HostWords(PROGRESS_BYTES)
        self.mirror = mirror
        if memory.region.nbytes < PROGRESS_BYTES:
            raise ValueError(f"a progress word needs {PROGRESS_BYTES} bytes")
        self._memory = memory
        # Host memory is written in place; other memory through a host copy of the words.
        self._in_place = isinstance(memory, HostWords)
        self._words = (
            memory.array[:PROGRESS_BYTES].view("<u8")
            if isinstance(memory, HostWords)
            else np.zeros(3, dtype="<u8")
        )
        self._agent = agent
        self.region = memory.region
        self.version = 0

    def _set(self, *values: tuple[int, int], wait: bool = True) -> None:
        """Stores (word index, value) pairs in turn, after every word stored before."""
        for index, value in values:
            self._words[index] = value
            if self.mirror is not None:
                self.mirror.store(index, value)
        if not self._in_place:
            self._memory.write_words([(8 * index, value) for index, value in values], wait=wait)

    @property
    def location(self) -> ShardLocation:
        """Where children read the word (for `sources.Offer.progress`)."""
        return ShardLocation(
            agent=self._agent,
            address=self.region.address,
            nbytes=PROGRESS_BYTES,
            shape=(PROGRESS_BYTES,),
            strides=c_strides((PROGRESS_BYTES,)),
            mem_type=self.region.mem_type,
            device_id=self.region.device_id,
        )

    def start(self, version: int, *, wait: bool = True) -> None:
        """Begin filling `version`: nothing filled; readers of the previous version see their
        copy gone (the version word changes last, after the fill is reset). With `wait` off
        the words are only queued (before any later store): `flush` waits for them to land,
        as the copy must before its memory is overwritten."""
        if version >= 1 << 63:
            raise ValueError(f"version {version} does not fit a progress word")
        tag = (version & _TAG_MASK) << _FILLED_BITS
        self._set((1, tag), (2, tag | CopyProgress.FILLING), (0, version), wait=wait)
        self.version = version

    def flush(self) -> None:
        """Waits until every word stored so far has landed."""
        if not self._in_place:
            self._memory.write_words([], wait=True)

    def filled(self, nbytes: int) -> None:
        """The copy holds `nbytes` from its first byte. Not waited for: readers see it soon,
        and never after a later store (`start`, `finish`), which waits for it."""
        if not 0 <= nbytes <= _FILLED_MASK:
            raise ValueError(f"{nbytes} bytes do not fit a progress word")
        self._set((1, ((self.version & _TAG_MASK) << _FILLED_BITS) | nbytes), wait=False)

    def finish(self, state: CopyProgress) -> None:
        self._set((2, ((self.version & _TAG_MASK) << _FILLED_BITS) | state))

    def read(self) -> ProgressWord:
        return ProgressWord.decode(self._memory.read(0, PROGRESS_BYTES))

    def close(self) -> None:
        """Remove the mirror, if any (the words in registered memory stay the caller's)."""
        if self.mirror is not None:
            self.mirror.close()
