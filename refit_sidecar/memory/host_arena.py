"""The memory behind a `ShardSource`: one contiguous allocation, registered with NIXL once.

`HostArena` is an aligned numpy buffer (DRAM) and keeps the data plane torch-free;
`refit_sidecar.memory.tensor_arena.TorchArena` is one torch tensor on a device (VRAM on a GPU), for
a trainer whose shards already live there. Only host memory has a host view: device memory is
written with device copies and never read back on the host.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from refit_sidecar.core.manifest import MemType


class Arena(Protocol):
    @property
    def address(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def mem_type(self) -> MemType: ...

    @property
    def device_id(self) -> int: ...

    def host_view(self, start: int, nbytes: int) -> np.ndarray:
        """Bytes [start, start + nbytes) as a writable uint8 array (no copy); DRAM only."""
        ...


def aligned_skip(address: int, alignment: int) -> int:
    """Bytes to skip from `address` to the next multiple of `alignment`."""
    return -address % alignment


class HostArena:
    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    @classmethod
    def allocate(cls, nbytes: int, alignment: int) -> HostArena:
        raw = np.zeros(nbytes + alignment, np.uint8)
        skip = aligned_skip(raw.ctypes.data, alignment)
        return cls(raw[skip : skip + nbytes])

    @property
    def address(self) -> int:
        return int(self.array.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    @property
    def mem_type(self) -> MemType:
        return MemType.DRAM

    @property
    def device_id(self) -> int:
        return 0

    def host_view(self, start: int, nbytes: int) -> np.ndarray:
        return self.array[start : start + nbytes]
