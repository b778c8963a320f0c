"""What a published weights version is made of, and where each byte of it can be read.

Torch-free records, built by the sources (one per trainer rank) and read by the planner:
a `Manifest` lists `ParameterRecord`s (Megatron global name, global shape, dtype) whose
`ShardRecord`s say which boxes of the global tensor a source buffer holds (`ShardPiece`s) and
where that buffer lives (`ShardLocation`: NIXL agent, address, local shape, element strides).
A rank holding [gate_r; up_r] of linear_fc1 has one shard with two pieces.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


class DType(enum.Enum):
    """Element types on the wire (common.proto DType)."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    INT64 = "int64"
    INT32 = "int32"
    UINT8 = "uint8"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]


_ITEMSIZE = {
    DType.FLOAT32: 4,
    DType.BFLOAT16: 2,
    DType.FLOAT16: 2,
    DType.INT64: 8,
    DType.INT32: 4,
    DType.UINT8: 1,
}


class MemType(enum.Enum):
    DRAM = "DRAM"
    VRAM = "VRAM"


def c_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a C-order (row-major) tensor of `shape`."""
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Box:
    """Per-dimension half-open ranges [start, stop) of a tensor; never empty."""

    ranges: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        for start, stop in self.ranges:
            if not 0 <= start < stop:
                raise ValueError(f"box ranges must satisfy 0 <= start < stop, got {self.ranges}")

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        return cls(tuple((0, extent) for extent in shape))

    @classmethod
    def at(cls, start: Sequence[int], shape: Sequence[int]) -> Box:
        return cls(tuple((s, s + n) for s, n in zip(start, shape, strict=True)))

    @property
    def start(self) -> tuple[int, ...]:
        return tuple(s for s, _ in self.ranges)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.ranges)

    @property
    def ndim(self) -> int:
        return len(self.ranges)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == self.ndim and all(
            stop <= extent for (_, stop), extent in zip(self.ranges, shape, strict=True)
        )

    def intersect(self, other: Box) -> Box | None:
        if other.ndim != self.ndim:
            raise ValueError(f"cannot intersect a {self.ndim}-d box with a {other.ndim}-d box")
        ranges = tuple(
            (max(a, c), min(b, d)) for (a, b), (c, d) in zip(self.ranges, other.ranges, strict=True)
        )
        return Box(ranges) if all(s < e for s, e in ranges) else None

    def contains(self, other: Box) -> bool:
        return self.intersect(other) == other


@dataclass(frozen=True)
class ShardPiece:
    """A box of the global tensor held by a shard, starting at `local_start` in the shard."""

    box: Box
    local_start: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.local_start) != self.box.ndim or min(self.local_start, default=0) < 0:
            raise ValueError(f"local_start {self.local_start} does not fit box {self.box}")


VERSION_WORD_BYTES = 8
"""A source's version word (`AgentRecord.version_word`): one little-endian uint64."""


@dataclass(frozen=True, kw_only=True)
class ShardLocation:
    """A source buffer holding one rank's local tensor, readable over NIXL."""

    agent: str
    """NIXL agent name of the source that registered the buffer."""
    address: int
    """Address of the local tensor's first element in the agent's registered memory."""
    nbytes: int
    shape: tuple[int, ...]
    """Local (per-rank) tensor shape."""
    strides: tuple[int, ...]
    """Element strides of the local tensor; `c_strides(shape)` for a contiguous buffer."""
    mem_type: MemType = MemType.DRAM
    device_id: int = 0

    def __post_init__(self) -> None:
        if not self.agent:
            raise ValueError("a shard location needs an agent name")
        if self.address < 0 or self.nbytes <= 0 or self.device_id < 0:
            raise ValueError(f"bad address/nbytes/device_id in {self}")
        if len(self.strides) != len(self.shape) or any(s <= 0 for s in self.strides):
            raise ValueError(f"strides {self.strides} do not fit shape {self.shape}")

    @classmethod
    def contiguous(
        cls,
        *,
        agent: str,
        address: int,
        shape: Sequence[int],
        itemsize: int,
        mem_type: MemType = MemType.DRAM,
        device_id: int = 0,
    ) -> ShardLocation:
        """A C-order buffer of `shape` starting at `address`."""
        shape = tuple(shape)
        return cls(
            agent=agent,
            address=address,
            nbytes=math.prod(shape) * itemsize,
            shape=shape,
            strides=c_strides(shape),
            mem_type=mem_type,
            device_id=device_id,
        )

    def span(self, itemsize: int) -> int:
        """Bytes from the first to past the last element."""
        return (sum((n - 1) * s for n, s in zip(self.shape, self.strides, strict=True)) + 1) * (
            itemsize
        )


@dataclass(frozen=True)
class ShardRecord:
    location: ShardLocation
    pieces: tuple[ShardPiece, ...]
    crc32: int | None = None
    """zlib CRC-32 of the buffer's `nbytes` bytes, when the source computed it."""
    rank: int = 0
    """Global trainer rank that published the shard (informational, as the next two)."""
    tensor_rank: int = 0
    pipeline_stage: int = 0
    sum64: int | None = None
    """WSUM-64 (`wsum`) of the buffer's bytes, when the source computed it (device slots)."""
    expert_rank: int = 0
    """An expert tensor's expert-parallel rank (informational, as `rank`; 0 otherwise)."""
    expert_tensor_rank: int = 0
    """An expert tensor's expert-tensor-parallel rank (0 otherwise)."""


@dataclass(frozen=True)
class ParameterRecord:
    name: str
    """Megatron global name (layer indices already offset by the PP stage)."""
    shape: tuple[int, ...]
    dtype: DType
    shards: tuple[ShardRecord, ...]

    def __post_init__(self) -> None:
        for shard in self.shards:
            loc = shard.location
            if len(loc.shape) != len(self.shape):
                raise ValueError(f"{self.name}: shard shape {loc.shape} vs global {self.shape}")
            if loc.span(self.dtype.itemsize) > loc.nbytes:
                raise ValueError(f"{self.name}: shard of shape {loc.shape} exceeds its nbytes")
            for piece in shard.pieces:
                if not piece.box.within(self.shape):
                    raise ValueError(f"{self.name}: piece {piece.box} outside {self.shape}")
                if not Box.at(piece.local_start, piece.box.shape).within(loc.shape):
                    raise ValueError(f"{self.name}: piece {piece} outside local {loc.shape}")


@dataclass(frozen=True)
class SnapshotPieces:
    """A slot whose snapshot is copied in pieces, each followed by its word
    (`AgentRecord.pieces`, docs/refit.md "Reading behind the snapshot copy"): piece i is bytes
    [ends[i - 1], ends[i]) of the slot from `slot_address` (the first from 0), copied in order;
    word i, `VERSION_WORD_BYTES` at `words.address + 8 * i`, names the version once the piece's
    bytes landed. The last word is the agent's version word."""

    words: ShardLocation
    slot_address: int
    ends: tuple[int, ...]

    def __post_init__(self) -> None:
        ends = self.ends
        if not ends or ends[0] <= 0 or any(b <= a for a, b in itertools.pairwise(ends)):
            raise ValueError(f"piece ends must be positive and increasing, got {ends}")
        if self.words.nbytes != len(ends) * VERSION_WORD_BYTES or self.slot_address < 0:
            raise ValueError(
                f"{len(ends)} pieces need {len(ends) * VERSION_WORD_BYTES} bytes of words, "
                f"got {self.words.nbytes}"
            )

    @property
    def last_word(self) -> int:
        """Address of the last piece's word."""
        return self.words.address + (len(self.ends) - 1) * VERSION_WORD_BYTES

    def piece_of(self, end: int) -> int:
        """The piece holding the byte before address `end` (a read's end); ValueError when it
        lies outside the slot."""
        offset = end - self.slot_address
        if not 0 < offset <= self.ends[-1]:
            raise ValueError(
                f"a read ending at {end:#x} lies outside the slot at {self.slot_address:#x} "
                f"({self.ends[-1]} bytes)"
            )
        return bisect.bisect_left(self.ends, offset)


@dataclass(frozen=True)
class AgentRecord:
    """How a puller reaches a source agent: its metadata blob, or a listener to fetch it from."""

    name: str
    metadata: bytes = b""
    """`get_agent_metadata()` of the source, taken after it registered its memory."""
    host: str = ""
    port: int | None = None
    """The source's metadata listener, used when `metadata` is empty."""
    rank: int = 0
    version_word: ShardLocation | None = None
    """Where the source's slot holds the number of the version its bytes are (8 bytes,
    little-endian), written once the bytes have landed: a receiver that leased a version before
    it was readable reads this until it names that version (`version_word.VersionWords`)."""
    pieces: SnapshotPieces | None = None
    """Set when the slot's snapshot is copied in pieces, each named by a word once it landed:
    such a receiver reads each piece behind the copy (`piece_gate.PieceGate`)."""

    def __post_init__(self) -> None:
        if not self.metadata and (not self.host or self.port is None):
            raise ValueError(f"agent {self.name!r} needs metadata or a listener host and port")
        word = self.version_word
        if word is not None and (word.agent != self.name or word.nbytes != VERSION_WORD_BYTES):
            raise ValueError(
                f"agent {self.name!r}: its version word must be {VERSION_WORD_BYTES} bytes of "
                f"its own memory, got {word.nbytes} bytes of {word.agent!r}"
            )
        pieces = self.pieces
        if pieces is not None and (
            word is None
            or pieces.words.agent != self.name
            or (pieces.last_word, pieces.words.mem_type, pieces.words.device_id)
            != (word.address, word.mem_type, word.device_id)
        ):
            raise ValueError(f"agent {self.name!r}: its pieces' last word must be its version word")


@dataclass(frozen=True)
class Manifest:
    version: int
    parameters: tuple[ParameterRecord, ...]
    agents: Mapping[str, AgentRecord]
    _index: dict[str, ParameterRecord] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index = {p.name: p for p in self.parameters}
        if len(index) != len(self.parameters):
            raise ValueError("parameter names in a manifest must be unique")
        for name, agent in self.agents.items():
            if agent.name != name:
                raise ValueError(f"agent record {agent.name!r} filed under {name!r}")
        for p in self.parameters:
            for shard in p.shards:
                if shard.location.agent not in self.agents:
                    raise ValueError(f"{p.name}: unknown agent {shard.location.agent!r}")
        object.__setattr__(self, "_index", index)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.parameters)

    def get(self, name: str) -> ParameterRecord | None:
        return self._index.get(name)


def merge_manifests(parts: Iterable[Manifest]) -> Manifest:
    """One manifest from the per-rank ones: shards of equal names are pooled."""
    parts = list(parts)
    if not parts or len({m.version for m in parts}) != 1:
        raise ValueError("merge needs at least one manifest, all of the same version")
    records: dict[str, ParameterRecord] = {}
    agents: dict[str, AgentRecord] = {}
    for part in parts:
        for name, agent in part.agents.items():
            if agents.setdefault(name, agent) != agent:
                raise ValueError(f"agent {name!r} is described differently by two manifests")
        for p in part.parameters:
            seen = records.get(p.name)
            if seen is None:
                records[p.name] = p
            elif (seen.shape, seen.dtype) != (p.shape, p.dtype):
                raise ValueError(f"{p.name}: shapes/dtypes differ between ranks")
            else:
                records[p.name] = ParameterRecord(p.name, p.shape, p.dtype, seen.shards + p.shards)
    return Manifest(parts[0].version, tuple(records.values()), agents)
