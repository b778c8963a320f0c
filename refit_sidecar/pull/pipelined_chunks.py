"""A pipelined pull's chunks: its plan's reads cut per source into chunks of about
`chunk_bytes` (`chunking`), a peer's in the order of its own buffer, a trainer rank's in the
destination's, each with the bytes its source's copy must hold before it is read. A layout
pulled before (every version of a steady tree) takes its chunks from a cache shared by the
receiver's threads instead of cutting its reads again.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from refit_sidecar.core.manifest import MemType
from refit_sidecar.core.plan import PullPlan
from refit_sidecar.memory.region import Region
from refit_sidecar.pull.chunking import chunk_bounds, cut_at, merge_continuing
from refit_sidecar.pull.filled import Filled
from refit_sidecar.pull.peer_words import PeerGate


@dataclass(eq=False)
class Chunk:
    agent: str
    mem_type: MemType
    remote: np.ndarray
    """N×3 uint64 (address, length, device) of the source's memory."""
    local: np.ndarray
    ranges: np.ndarray
    """N×2 int64 (destination offset, length)."""
    need: int
    """Bytes the source's copy must hold, from its first byte (0: a trainer rank)."""
    done_seq: int = -1

    @property
    def nbytes(self) -> int:
        return int(self.ranges[:, 1].sum())


_CUTS_KEPT = 16
_CUTS_LOCK = threading.Lock()
_CUTS: OrderedDict[bytes, tuple[tuple[Any, ...], ...]] = OrderedDict()
"""Chunks by `_cut_key`: the arrays of each are never written, so runs share them."""
_CUT_KEYS: OrderedDict[int, tuple[object, tuple[Any, ...], bytes]] = OrderedDict()
"""The last plans' reads digested, by the identity of their list (which each entry holds,
so it is not reused meanwhile), with the rest of the key and the digest."""


def _cut_key(
    plan: PullPlan, dest: Region, peers: Mapping[str, PeerGate], chunk_bytes: int, taper: int
) -> bytes:
    """A digest of everything `cut` reads: where each read comes from and goes,
    the destination, the peers' bases and the chunk size (a new version of one layout differs
    only in its checksums, which chunks do not carry). A plan whose reads are the very list
    of a plan digested lately (a tree receiver replays its routed plan for every version)
    takes that digest again, without hashing every read's arrays at the pull's start. Under
    `_CUTS_LOCK`."""
    bases = tuple(sorted((agent, gate.base) for agent, gate in peers.items()))
    rest = (dest.address, dest.device_id, bases, chunk_bytes, taper)
    known = _CUT_KEYS.get(id(plan.reads))
    if known is not None and known[0] is plan.reads and known[1] == rest:
        return known[2]
    digest = hashlib.blake2b(repr(rest).encode(), digest_size=16)
    for reads in plan.reads:
        loc = reads.location
        digest.update(f"{loc.agent}|{loc.mem_type.value}|{loc.device_id}".encode())
        for array in (reads.remote_addresses, reads.lengths, reads.dest_offsets):
            digest.update(np.ascontiguousarray(array).tobytes())
    key = digest.digest()
    _CUT_KEYS[id(plan.reads)] = (plan.reads, rest, key)
    while len(_CUT_KEYS) > _CUTS_KEPT:
        _CUT_KEYS.popitem(last=False)
    return key


def chunks_of(
    plan: PullPlan,
    dest: Region,
    filled: Filled,
    peers: Mapping[str, PeerGate],
    *,
    chunk_bytes: int,
    taper: int,
) -> list[Chunk]:
    """A run's chunks; a first run of a layout pulled before (every version of a steady
    tree) takes them from `_CUTS` instead of cutting the reads again."""
    if filled.by_source:  # a run after a source failed: only what did not land
        return cut(plan, dest, filled, peers, chunk_bytes=chunk_bytes, taper=taper)
    with _CUTS_LOCK:  # the ranks of a receiver process pull at once, from threads
        key = _cut_key(plan, dest, peers, chunk_bytes, taper)
        known = _CUTS.get(key)
        if known is not None:
            _CUTS.move_to_end(key)
    if known is None:
        known = tuple(
            (c.agent, c.mem_type, c.remote, c.local, c.ranges, c.need)
            for c in cut(plan, dest, filled, peers, chunk_bytes=chunk_bytes, taper=taper)
        )
        with _CUTS_LOCK:
            _CUTS[key] = known
            while len(_CUTS) > _CUTS_KEPT:
                _CUTS.popitem(last=False)
    return [Chunk(*fields) for fields in known]


def cut(
    plan: PullPlan,
    dest: Region,
    filled: Filled,
    peers: Mapping[str, PeerGate],
    *,
    chunk_bytes: int,
    taper: int,
) -> list[Chunk]:
    """`plan`'s reads cut into chunks, less what `filled` holds after a run that failed."""
    size = chunk_bytes
    by_source: dict[tuple[str, MemType], list[tuple[np.ndarray, ...]]] = {}
    for reads in plan.reads:
        loc = reads.location
        by_source.setdefault((loc.agent, loc.mem_type), []).append(
            (reads.remote_addresses, reads.lengths.astype(np.uint64), reads.dest_offsets)
        )
    out: list[Chunk] = []
    for (agent, mem_type), parts in by_source.items():
        remote = np.concatenate([p[0] for p in parts])
        length = np.concatenate([p[1] for p in parts]).astype(np.int64)
        dst = np.concatenate([p[2] for p in parts]).astype(np.int64)
        device = next(r.location.device_id for r in plan.reads if r.location.agent == agent)
        gate = peers.get(agent)
        # A peer's copy is read in the order of its own buffer, a trainer rank's in the
        # destination's; chunks are cut along that order.
        order = np.argsort(remote if gate is not None else dst, kind="stable")
        remote, length, dst = remote[order], length[order], dst[order]
        bounds = chunk_bounds(int(length.sum()), size, taper)
        remote, length, dst, chunk = cut_at(remote, length, dst, bounds)
        if filled.by_source:  # a run after a source failed: skip what did land
            keep = np.array(
                [
                    not filled.valid.covers(int(d), int(d + n))
                    for d, n in zip(dst, length, strict=True)
                ],
                dtype=bool,
            )
            remote, dst, length, chunk = remote[keep], dst[keep], length[keep], chunk[keep]
        if not len(length):
            continue
        remote, length, dst, chunk = merge_continuing(remote, length, dst, chunk)
        for idx in np.split(np.arange(len(chunk)), np.flatnonzero(np.diff(chunk)) + 1):
            r, n, d = remote[idx], length[idx], dst[idx]
            dev = np.full(len(idx), device, np.uint64)
            local = np.stack(
                [
                    d.astype(np.uint64) + np.uint64(dest.address),
                    n.astype(np.uint64),
                    np.full(len(idx), dest.device_id, np.uint64),
                ]
            ).T
            need = 0 if gate is None else int((r + n.astype(np.uint64)).max()) - gate.base
            out.append(
                Chunk(
                    agent,
                    mem_type,
                    np.ascontiguousarray(np.stack([r, n.astype(np.uint64), dev]).T),
                    np.ascontiguousarray(local),
                    np.stack([d, n]).T,
                    need,
                )
            )
    return out
