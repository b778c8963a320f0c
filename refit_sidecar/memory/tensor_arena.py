"""A `ShardSource` arena that is one torch uint8 tensor: VRAM on a CUDA device, DRAM on the CPU.

A trainer on a GPU snapshots its shards with device-local copies into typed views of the arena
(`tensor_view`); the same code runs against CPU memory in the CPU tests. The only module of the
data plane that imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from refit_sidecar.core.manifest import MemType
from refit_sidecar.memory.host_arena import aligned_skip
from refit_sidecar.memory.region import Region


def memory_of(device: torch.device) -> tuple[MemType, int]:
    """NIXL memory type and device id of memory on `device`."""
    if device.type == "cuda":
        return MemType.VRAM, torch.cuda.current_device() if device.index is None else device.index
    if device.type == "cpu":
        return MemType.DRAM, 0
    raise ValueError(f"no NIXL memory type for device {device}")


class TorchArena:
    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError("an arena is a contiguous 1-d uint8 tensor")
        self.tensor = tensor
        self._memory = memory_of(tensor.device)

    @classmethod
    def allocate(cls, nbytes: int, alignment: int, *, device: torch.device) -> TorchArena:
        """Zeroed, so a slot never exposes stale device memory; one allocation per arena."""
        raw = torch.zeros(nbytes + alignment, dtype=torch.uint8, device=device)
        skip = aligned_skip(raw.data_ptr(), alignment)
        return cls(raw[skip : skip + nbytes])

    @property
    def address(self) -> int:
        return int(self.tensor.data_ptr())

    @property
    def nbytes(self) -> int:
        return int(self.tensor.numel())

    @property
    def mem_type(self) -> MemType:
        return self._memory[0]

    @property
    def device_id(self) -> int:
        return self._memory[1]

    def host_view(self, start: int, nbytes: int) -> np.ndarray:
        if self.mem_type is not MemType.DRAM:
            raise ValueError("device memory has no host view")
        return self.tensor[start : start + nbytes].numpy()

    def tensor_view(self, start: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """A typed, writable view of the arena at byte `start` (which must suit `dtype`)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = math.prod(shape) * itemsize
        if start % itemsize or start + nbytes > self.nbytes:
            raise ValueError(f"{nbytes} bytes at {start} do not fit the arena as {dtype}")
        return self.tensor[start : start + nbytes].view(dtype).view(tuple(shape))


class TorchWords:
    """`progress.Words` in a small tensor on `device`: a receiver staging on a GPU keeps its
    progress word and the slots it reads its parents' words into in device memory, next to
    its copy. On a GPU each word goes through pinned host memory, copied on a stream of its
    own, so that it waits for nothing else this process has queued (the legacy default stream
    would wait for every blocking stream of the process, the data copies in flight and an
    engine's kernels included). Copies on that one stream land in the order written, so a
    write that need not wait (`wait=False`: a copy's fill as it grows) is only queued; each
    queued word keeps a pinned slot of its own until its copy ran. Reads are synchronous."""

    _RING = 32
    """Pinned 8-byte slots for words in flight."""

    def __init__(self, nbytes: int, *, device: torch.device) -> None:
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        mem_type, device_id = memory_of(self.tensor.device)
        self._region = Region(
            int(self.tensor.data_ptr()), nbytes, mem_type, device_id, owner=self.tensor
        )
        self._stream: torch.cuda.Stream | None = None
        self._host = self.tensor
        if self.tensor.is_cuda:
            self._stream = torch.cuda.Stream(device=self.tensor.device)
            self._host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
            self._ring = torch.zeros(8 * self._RING, dtype=torch.uint8, pin_memory=True)
            self._ring_words = self._ring.numpy().view("<u8")
            self._landed: list[torch.cuda.Event | None] = [None] * self._RING
            self._next = 0

    @property
    def region(self) -> Region:
        return self._region

    def write_words(self, words: Sequence[tuple[int, int]], *, wait: bool = True) -> None:
        if self._stream is None:  # on a CPU, the words themselves
            staged = self._host.numpy()
            for offset, value in words:
                staged[offset : offset + 8].view("<u8")[0] = value
            return
        with torch.cuda.stream(self._stream):
            for offset, value in words:
                slot = self._next
                self._next = (slot + 1) % self._RING
                landed = self._landed[slot]
                if landed is not None:
                    landed.synchronize()  # its last word's copy ran (long ago, as a rule)
                self._ring_words[slot] = value
                self.tensor[offset : offset + 8].copy_(
                    self._ring[8 * slot : 8 * slot + 8], non_blocking=True
                )
                if landed is None:
                    landed = self._landed[slot] = torch.cuda.Event()
                landed.record(self._stream)
        if wait:
            self._stream.synchronize()

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        end = offset + nbytes
        if self._stream is None:
            return self.tensor[offset:end].cpu().numpy()
        with torch.cuda.stream(self._stream):
            self._host[offset:end].copy_(self.tensor[offset:end], non_blocking=True)
        self._stream.synchronize()
        return self._host[offset:end].numpy().copy()
