"""A destination or source buffer as registered memory: where it lies, how long, on which
device, and the host's view of host memory."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np

from refit_sidecar.core.manifest import MemType


@dataclass(frozen=True)
class Region:
    """A destination buffer: a contiguous range of host (DRAM) or device (VRAM) memory."""

    address: int
    nbytes: int
    mem_type: MemType = MemType.DRAM
    device_id: int = 0
    owner: object = field(default=None, compare=False, repr=False)
    """The object owning the memory (an array, a tensor), kept alive with the region."""

    @classmethod
    def of_array(cls, array: np.ndarray) -> Region:
        if not array.flags.c_contiguous:
            raise ValueError("a destination array must be C-contiguous")
        return cls(array.ctypes.data, array.nbytes, owner=array)


def host_view(region: Region) -> np.ndarray:
    """The bytes of a DRAM region as a writable uint8 array (no copy)."""
    if region.mem_type is not MemType.DRAM:
        raise ValueError("only DRAM regions can be viewed from the host")
    if region.nbytes == 0:
        return np.zeros(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * region.nbytes).from_address(region.address))
