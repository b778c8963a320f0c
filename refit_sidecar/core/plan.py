"""Which byte ranges of which source shards a receiver reads, and where each one lands.

Pure arithmetic over a `Manifest` (no torch, no NIXL). A receiver asks for boxes of global
tensors (`Want`); the plan lays the boxes out back to back, each in C order, in one destination
buffer (`PullTarget`) and lists per source shard the reads that fill it (`ShardReads`).
Contiguous runs are merged: a row range of a dim-0 shard is one read, a column range of a dim-1
shard one read per row and shard. Where several shards hold the same bytes (replicas), each
region is read once, from the source agent with the fewest bytes assigned so far.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from refit_sidecar.core.manifest import (
    AgentRecord,
    Box,
    DType,
    Manifest,
    ParameterRecord,
    ShardLocation,
    ShardPiece,
    c_strides,
)


class UnsupportedRequest(ValueError):
    """A wanted box the manifest cannot serve: unknown name, bad box, or bytes no shard holds."""


@dataclass(frozen=True)
class Want:
    name: str
    box: Box


@dataclass(frozen=True)
class PullTarget:
    """A wanted box, stored C-order at `offset` of the destination buffer."""

    name: str
    box: Box
    dtype: DType
    offset: int
    nbytes: int

    @property
    def span(self) -> slice:
        return slice(self.offset, self.offset + self.nbytes)


class Checksums(NamedTuple):
    """What a source published to check one shard by: the CRC-32 (host slots) and the WSUM-64
    (device slots, `wsum`); None where it published none."""

    crc32: int | None = None
    sum64: int | None = None


@dataclass(frozen=True, eq=False)
class ShardReads:
    """Reads from one source shard, ordered by destination offset (int64 byte arrays)."""

    parameter: str
    shard: int
    """Index into the parameter record's shards."""
    location: ShardLocation
    crc32: int | None
    complete: bool
    """True when the reads tile the whole shard buffer once, so its checksum can be checked."""
    shard_offsets: np.ndarray
    lengths: np.ndarray
    dest_offsets: np.ndarray
    sum64: int | None = None
    """The shard's WSUM-64 (`wsum`), when its source published one."""
    position: int = 0
    """Where the shard lies in the manifest's flat shard order (`ShardOrder`): the same for
    every receiver of the manifest, so the workers of an engine can add up what each read of
    it (`integrity/partial_sums.py`)."""

    @property
    def remote_addresses(self) -> np.ndarray:
        return self.shard_offsets.astype(np.uint64) + np.uint64(self.location.address)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())


@dataclass(frozen=True, eq=False)
class ShardOrder:
    """Every shard of a manifest in its flat order (parameters in order, each one's shards in
    order, as `Lease.checksums` lists them): what receivers of the same manifest share to
    name a shard by one number. Depends on the layout alone."""

    names: tuple[str, ...]
    """The parameters, in order."""
    first: np.ndarray
    """Per parameter: the position of its first shard; then the number of shards (int64)."""
    units: np.ndarray
    """Per shard: its size in WSUM-64 units (2 bytes; int64)."""

    @classmethod
    def of(cls, manifest: Manifest) -> ShardOrder:
        counts = [len(p.shards) for p in manifest.parameters]
        first = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        units = np.array(
            [s.location.nbytes // 2 for p in manifest.parameters for s in p.shards], np.int64
        )
        return cls(tuple(p.name for p in manifest.parameters), first, units)

    @property
    def count(self) -> int:
        return int(self.first[-1])

    def name(self, position: int) -> tuple[str, int]:
        """The parameter and shard index at flat `position`."""
        parameter = int(np.searchsorted(self.first, position, side="right")) - 1
        return self.names[parameter], position - int(self.first[parameter])


@dataclass(frozen=True, eq=False)
class PullPlan:
    version: int
    targets: tuple[PullTarget, ...]
    reads: tuple[ShardReads, ...]
    agents: Mapping[str, AgentRecord]
    """The source agents the reads go to."""
    nbytes: int
    """Destination buffer size."""
    layout: str = ""
    """`layout_key` of the manifest planned from: `rebase` replays the plan on any version
    with the same key."""
    shard_order: ShardOrder | None = None
    """The manifest's shards in order (`ShardReads.position` indexes them)."""

    @property
    def num_reads(self) -> int:
        return sum(len(r.lengths) for r in self.reads)

    @property
    def bytes_read(self) -> int:
        return sum(r.nbytes for r in self.reads)


def whole(manifest: Manifest, names: Sequence[str] | None = None) -> list[Want]:
    """Wants for entire tensors: all of the manifest's, or `names` (e.g. one PP stage's)."""
    wanted = manifest.names if names is None else names
    out = []
    for name in wanted:
        record = manifest.get(name)
        if record is None:
            raise UnsupportedRequest(f"{name!r} is not in manifest version {manifest.version}")
        out.append(Want(name, Box.full(record.shape)))
    return out


def in_copy_order(manifest: Manifest, wants: Sequence[Want]) -> list[int]:
    """The indices of `wants` in the order their bytes sit in the sources' slots: by where the
    first shard holding any of a want's box starts in its agent's memory (from the agent's
    slot, or its first shard), boxes of one tensor in their given order. A destination laid
    out in this order is read front to back while a trainer rank copies its slot front to
    back, so a pull can read behind the copy (docs/refit.md, "Reading behind the snapshot
    copy"); Megatron lays its parameter buffer out last layer first, the opposite of the HF
    names' order."""
    bases: dict[str, int] = {}
    for record in manifest.parameters:
        for shard in record.shards:
            name, address = shard.location.agent, shard.location.address
            bases[name] = min(bases.get(name, address), address)
    for name, agent in manifest.agents.items():
        if agent.pieces is not None:
            bases[name] = agent.pieces.slot_address

    def position(want: Want) -> int:
        record = _record(manifest, want)
        return min(
            (
                shard.location.address - bases[shard.location.agent]
                for shard in record.shards
                if any(piece.box.intersect(want.box) is not None for piece in shard.pieces)
            ),
            default=0,
        )

    return sorted(range(len(wants)), key=lambda i: position(wants[i]))


def plan_pull(manifest: Manifest, wants: Sequence[Want], *, align: int = 256) -> PullPlan:
    if align <= 0 or align & (align - 1):
        raise ValueError(f"align must be a power of two, got {align}")
    targets: list[PullTarget] = []
    order = ShardOrder.of(manifest)
    firsts = dict(zip(order.names, order.first.tolist(), strict=False))
    load: dict[str, int] = defaultdict(int)
    runs: dict[tuple[str, int], list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    offset = 0
    for want in wants:
        record = _record(manifest, want)
        target = PullTarget(
            want.name, want.box, record.dtype, offset, want.box.numel * record.dtype.itemsize
        )
        targets.append(target)
        for shard, piece, cell in _cover(record, want.box, load):
            runs.setdefault((record.name, shard), []).append(
                _runs(record, shard, piece, cell, target)
            )
        offset = -(-(offset + target.nbytes) // align) * align
    reads = tuple(
        _merge(manifest, name, shard, parts, firsts[name] + shard)
        for (name, shard), parts in runs.items()
    )
    agents = {r.location.agent: manifest.agents[r.location.agent] for r in reads}
    end = max((t.offset + t.nbytes for t in targets), default=0)
    key = layout_key(manifest)
    return PullPlan(manifest.version, tuple(targets), reads, agents, end, key, order)


def layout_key(manifest: Manifest) -> str:
    """A digest of everything a plan depends on except where the bytes are: names, shapes,
    dtypes, and per shard its rank, pieces and local layout. Versions published by the same
    trainer layout share it, whichever slot (agent, address) holds them."""
    digest = hashlib.blake2b(digest_size=16)
    for record in manifest.parameters:
        digest.update(repr((record.name, record.shape, record.dtype.value)).encode())
        for shard in record.shards:
            loc = shard.location
            shape = (loc.shape, loc.strides, loc.nbytes, loc.mem_type.value, loc.device_id)
            digest.update(repr((shard.rank, shard.pieces, shape)).encode())
    return digest.hexdigest()


def rebase(plan: PullPlan, manifest: Manifest, *, layout: str | None = None) -> PullPlan:
    """`plan` replayed on `manifest`, a version of the same layout: the same byte ranges and
    destinations, read from wherever that version's shards live (O(shards), no re-planning).
    `layout` is `layout_key(manifest)` when the caller has it already."""
    key = layout_key(manifest) if layout is None else layout
    if key != plan.layout:
        raise UnsupportedRequest(
            f"manifest version {manifest.version} has another layout than the plan's "
            f"(version {plan.version}); plan it anew"
        )
    reads = []
    for r in plan.reads:
        record = manifest.get(r.parameter)
        assert record is not None  # same layout key, so same names and shards
        shard = record.shards[r.shard]
        reads.append(replace(r, location=shard.location, crc32=shard.crc32, sum64=shard.sum64))
    agents = {r.location.agent: manifest.agents[r.location.agent] for r in reads}
    return replace(plan, version=manifest.version, reads=tuple(reads), agents=agents)


def checksums_by_parameter(
    order: Sequence[tuple[str, int]], flat: Sequence[Checksums]
) -> dict[str, tuple[Checksums, ...]]:
    """`flat` (every shard's checksums in a manifest's order, as `Lease.checksums` carries
    them) per parameter, given the manifest's (parameter, number of shards) in order."""
    if sum(n for _, n in order) != len(flat):
        raise ValueError(f"{len(flat)} checksums for {sum(n for _, n in order)} shards")
    out, at = {}, 0
    for name, count in order:
        out[name] = tuple(flat[at : at + count])
        at += count
    return out


def with_read_checksums(plan: PullPlan, checksums: Sequence[Checksums]) -> PullPlan:
    """`plan` with `checksums[i]` on its read `i` (the same reads otherwise)."""
    if len(checksums) != len(plan.reads):
        raise ValueError(f"{len(checksums)} checksums for {len(plan.reads)} reads")
    reads = tuple(
        replace(r, crc32=sums.crc32, sum64=sums.sum64)
        for r, sums in zip(plan.reads, checksums, strict=True)
    )
    return replace(plan, reads=reads)


def with_checksums(
    plan: PullPlan, version: int, checksums: Mapping[str, Sequence[Checksums]]
) -> PullPlan:
    """`plan` for `version`, a version with the same manifest but its version number and
    checksums (`Lease.manifest_key` equal): same reads, the checksums given per parameter and
    shard."""
    per_read = [checksums[r.parameter][r.shard] for r in plan.reads]
    return with_read_checksums(replace(plan, version=version), per_read)


def _record(manifest: Manifest, want: Want) -> ParameterRecord:
    record = manifest.get(want.name)
    if record is None:
        raise UnsupportedRequest(f"{want.name!r} is not in manifest version {manifest.version}")
    if not want.box.within(record.shape):
        raise UnsupportedRequest(f"{want.name}: box {want.box} is outside shape {record.shape}")
    return record


def _cover(
    record: ParameterRecord, box: Box, load: dict[str, int]
) -> Iterator[tuple[int, ShardPiece, Box]]:
    """Split `box` into cells along every piece edge and pick one holder per cell: a shard
    already picked for this box if one holds the cell (fewer, checkable reads), else the one
    whose agent has the fewest bytes to serve."""
    used: set[int] = set()
    holders = [
        (index, piece, inter)
        for index, shard in enumerate(record.shards)
        for piece in shard.pieces
        if (inter := piece.box.intersect(box)) is not None
    ]
    cuts = [
        sorted({lo, hi, *(c for _, _, i in holders for c in i.ranges[d])})
        for d, (lo, hi) in enumerate(box.ranges)
    ]
    for ranges in itertools.product(*(list(itertools.pairwise(c)) for c in cuts)):
        cell = Box(ranges)
        options = [h for h in holders if h[2].contains(cell)]
        if not options:
            raise UnsupportedRequest(f"{record.name}: no shard holds {cell}")
        index, piece, _ = min(
            options,
            key=lambda h: (h[0] not in used, load[record.shards[h[0]].location.agent], h[0]),
        )
        used.add(index)
        load[record.shards[index].location.agent] += cell.numel * record.dtype.itemsize
        yield index, piece, cell


def _runs(
    record: ParameterRecord, shard: int, piece: ShardPiece, cell: Box, target: PullTarget
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(shard offsets, destination offsets, lengths) in bytes of the contiguous runs of `cell`."""
    src_strides = record.shards[shard].location.strides
    dst_strides = c_strides(target.box.shape)
    local = [
        ls + c - p for ls, c, p in zip(piece.local_start, cell.start, piece.box.start, strict=True)
    ]
    src0 = sum(i * s for i, s in zip(local, src_strides, strict=True))
    dst0 = sum(
        (c - w) * s for c, w, s in zip(cell.start, target.box.start, dst_strides, strict=True)
    )
    extents = cell.shape
    # Fold trailing dims into one run while both sides stay contiguous.
    outer, run = len(extents), 1
    while outer and (
        extents[outer - 1] == 1 or src_strides[outer - 1] == run == dst_strides[outer - 1]
    ):
        run *= extents[outer - 1]
        outer -= 1
    src = np.array([src0], dtype=np.int64)
    dst = np.array([dst0], dtype=np.int64)
    for d in range(outer):
        if extents[d] > 1:
            steps = np.arange(extents[d], dtype=np.int64)
            src = (src[:, None] + steps * src_strides[d]).ravel()
            dst = (dst[:, None] + steps * dst_strides[d]).ravel()
    item = record.dtype.itemsize
    return src * item, dst * item + target.offset, np.full(len(src), run * item, np.int64)


def _merge(
    manifest: Manifest,
    name: str,
    shard: int,
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    position: int,
) -> ShardReads:
    src, dst, length = (np.concatenate(column) for column in zip(*parts, strict=True))
    order = np.argsort(dst, kind="stable")
    src, dst, length = src[order], dst[order], length[order]
    end = src[:-1] + length[:-1]
    starts = np.flatnonzero(
        np.concatenate([[True], (src[1:] != end) | (dst[1:] != dst[:-1] + length[:-1])])
    )
    src, dst, length = src[starts], dst[starts], np.add.reduceat(length, starts)
    record = manifest.get(name)
    assert record is not None
    location = record.shards[shard].location
    by_src = np.argsort(src, kind="stable")
    s, n = src[by_src], length[by_src]
    complete = bool(
        s[0] == 0 and np.all(s[1:] == s[:-1] + n[:-1]) and s[-1] + n[-1] == location.nbytes
    )
    record_shard = record.shards[shard]
    return ShardReads(
        name,
        shard,
        location,
        record_shard.crc32,
        complete,
        src,
        length,
        dst,
        record_shard.sum64,
        position,
    )
