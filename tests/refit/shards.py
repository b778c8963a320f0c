"""Torch-free test helpers: random global tensors as raw bytes, numpy shards from specs, and
in-memory manifests. Also imported by the spawned NIXL source process (keep it light)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from refit_sidecar.core.manifest import (
    AgentRecord,
    Box,
    DType,
    Manifest,
    ParameterRecord,
    ShardLocation,
    ShardRecord,
)
from refit_sidecar.integrity.checksum import checksum
from refit_sidecar.publish.shard_specs import ShardSpec


def random_global(name: str, shape: Sequence[int], dtype: DType, seed: int) -> np.ndarray:
    """Random bytes shaped (*shape, itemsize): slicing boxes works without a numpy bf16."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    nbytes = int(np.prod(shape)) * dtype.itemsize
    return np.frombuffer(rng.bytes(nbytes), np.uint8).reshape(*shape, dtype.itemsize)


def index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box.ranges)


def shard_of(full: np.ndarray, spec: ShardSpec) -> np.ndarray:
    """The spec's local tensor (C order) cut out of the global bytes `full`."""
    local = np.zeros((*spec.local_shape, full.shape[-1]), np.uint8)
    for piece in spec.pieces:
        local[index(Box.at(piece.local_start, piece.box.shape))] = full[index(piece.box)]
    return local


def in_memory_manifest(
    version: int,
    placed: Sequence[tuple[str, ShardSpec, np.ndarray]],
) -> Manifest:
    """A manifest over numpy shard buffers: (agent, spec, buffer) per shard."""
    records: dict[str, ParameterRecord] = {}
    for agent, spec, buffer in placed:
        assert buffer.flags.c_contiguous and buffer.nbytes == spec.nbytes
        location = ShardLocation.contiguous(
            agent=agent,
            address=buffer.ctypes.data,
            shape=spec.local_shape,
            itemsize=spec.dtype.itemsize,
        )
        shard = ShardRecord(location, spec.pieces, checksum(buffer))
        seen = records.get(spec.parameter)
        shards = (seen.shards if seen else ()) + (shard,)
        records[spec.parameter] = ParameterRecord(spec.parameter, spec.shape, spec.dtype, shards)
    agents = {a: AgentRecord(a, metadata=b"in-memory") for a, _, _ in placed}
    return Manifest(version, tuple(records.values()), agents)
