"""Installing while the pull runs: exchanging staged bytes with the engine's own tensors.

Without it, a refit copies staging into the engine's tensors once the pull is over and
checked: a device-local copy of every byte, after the last one landed (2.0 ms for a 1B model
on an H100, 4.6 ms for 3B). An engine that hands the receiver the tensors it computes with
(`Receiver.fetch(version, exchange=...)`, by HF name) has them filled while the pull runs
instead: each HF slice that lies in staging exactly as the engine holds it (contiguous, the
same shape and dtype, the whole tensor) is **exchanged** with the engine's tensor as soon as
its bytes have landed and, when the pull is verified, once the sums of its checksums were
queued (`running_check.RunningCheck`'s `after` hook, on the GPU stream order).

An exchange, not a copy: afterwards the engine's tensor holds the new version and staging the
old one, so the refit is taken back whole, by the same exchange again, when anything after it
fails: a checksum that differs, a source lost, a lease that did not hold, another worker of
the engine failing before their agreement (`undo`). Copied in place as the bytes land, a failed
refit would leave the engine half-loaded; keeping a copy of the old version to restore would
cost a second model-sized buffer. The price is memory traffic: an exchange reads and writes
each byte twice (a copy once), on the GPU's own memory while the link fills staging at a
tenth of its bandwidth, on a stream of its own.

Slices that cannot be exchanged (a dtype the engine casts to, a slice assembled from several
reads, a box smaller than the tensor) reach the installer after the pull, as before. Since
staging then holds the old version of the exchanged slices, a receiver that serves its copy
to others (fan-out) cannot exchange.

On the GPU the exchange is a Triton kernel (each block loads both sides, then stores both)
over a table of 16 KiB blocks laid out once per layout: one launch exchanges every slice a
prefix made final (a launch per slice would cost the pull's listener lane a few milliseconds
of Python per refit). Elsewhere, and for a slice not aligned to 8 bytes, one launch per slice,
or three torch copies through a temporary on the CPU.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

_BLOCK = 4096
"""Elements per Triton program (16 KiB of int32)."""
_TABLE_BLOCK = 2048
"""8-byte words per block of the table kernel (16 KiB)."""


@dataclass(frozen=True)
class Swap:
    """One HF slice's staging bytes and the engine tensor they are exchanged with."""

    name: str
    end: int
    """Where the slice's last staged byte lies, plus one."""
    staged: torch.Tensor
    target: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.staged.numel() * self.staged.element_size()


def exchangeable(staged: torch.Tensor, target: torch.Tensor | None) -> bool:
    """Whether `target` can take `staged`'s bytes by exchange: the same shape, dtype and device,
    both contiguous, not overlapping."""
    if target is None or target.shape != staged.shape or target.dtype != staged.dtype:
        return False
    if target.device != staged.device or not (target.is_contiguous() and staged.is_contiguous()):
        return False
    nbytes = staged.numel() * staged.element_size()
    a, b = staged.data_ptr(), target.data_ptr()
    return a + nbytes <= b or b + nbytes <= a


class Exchange:
    """One refit's exchanges: queued in staging order as its prefix is ready (`upto`), waited
    for (`wait`) or taken back (`undo`). `upto` runs on one thread at a time (the pull's
    listener lane), `wait` and `undo` after the pull's lanes closed."""

    def __init__(
        self, swaps: Sequence[Swap], *, stream: Any = None, blocks: _Blocks | None = None
    ) -> None:
        """`swaps` in staging order; `stream`: the device stream they run on (made when None);
        `blocks`: their block table (`again`)."""
        self.swaps = swaps
        self.names = frozenset(swap.name for swap in swaps)
        self.nbytes = sum(swap.nbytes for swap in swaps)
        self._done = 0
        """Swaps queued so far (the first `_done` of `swaps`)."""
        self._lock = threading.Lock()
        device = swaps[0].staged.device if swaps else torch.device("cpu")
        if stream is None and device.type == "cuda":
            stream = torch.cuda.Stream(device=device)
        self.stream: Any = stream
        if blocks is None and device.type == "cuda":
            blocks = _Blocks.of(swaps)
        self._blocks = blocks

    def again(self) -> Exchange:
        """The same exchanges, none queued yet (for the next version of the same layout): the
        slices, the block table and the stream are shared; nothing is laid out again."""
        fresh = copy.copy(self)
        fresh._done = 0
        fresh._lock = threading.Lock()
        return fresh

    @classmethod
    def of(
        cls, staged: Iterable[tuple[str, int, torch.Tensor]], targets: Mapping[str, torch.Tensor]
    ) -> Exchange:
        """The exchanges of the slices (name, end offset in staging, staged tensor) that
        `targets` can take (`exchangeable`), in staging order; the others are left to the
        installer."""
        swaps = []
        for name, end, tensor in staged:
            target = targets.get(name)
            if target is not None and exchangeable(tensor, target):
                swaps.append(Swap(name, end, tensor, target))
        return cls(sorted(swaps, key=lambda swap: swap.end))

    @property
    def exchanged(self) -> int:
        """Slices exchanged (or queued to be)."""
        return self._done

    def upto(self, prefix: int) -> None:
        """Every staged byte before `prefix` is final (landed, and its checks queued on the
        current stream): queue the exchanges of the slices that lie there, behind what the
        current stream holds."""
        with self._lock:
            if self._done == len(self.swaps) or self.swaps[self._done].end > prefix:
                return
            stop = self._done
            while stop < len(self.swaps) and self.swaps[stop].end <= prefix:
                stop += 1
            with self._on_stream(after_current=True):
                self._run(self._done, stop)

    def wait(self) -> None:
        """Until every queued exchange has run."""
        if self.stream is not None:
            self.stream.synchronize()

    def undo(self) -> None:
        """Take back every exchange queued: the engine's tensors hold what they held before."""
        with self._lock:
            done, self._done = self.swaps[: self._done], 0
            if not done:
                return
            if self.stream is not None:
                torch.cuda.synchronize(self.stream.device)  # whatever the checks still run
            with self._on_stream(after_current=False):
                self._run(0, len(done))
            self._done = 0
            self.wait()
            log.info("took back %d exchanged tensors", len(done))

    def _run(self, start: int, stop: int) -> None:
        """Exchange `swaps[start:stop]` (their bytes are disjoint: the order is free); `_done`
        counts them as they are queued, so `undo` takes back exactly these."""
        if self._blocks is not None and self._blocks.launch(start, stop):
            self._done = max(self._done, stop)
            return
        for i in range(start, stop):
            swap = self.swaps[i]
            _exchange(swap.staged, swap.target)
            self._done = max(self._done, i + 1)

    @contextlib.contextmanager
    def _on_stream(self, *, after_current: bool) -> Iterator[None]:
        with torch.no_grad():
            if self.stream is None:
                yield
                return
            if after_current:
                self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            with torch.cuda.stream(self.stream):
                yield


class _Blocks:
    """The swaps' bytes cut into blocks of `_TABLE_BLOCK` 8-byte words: a device table of
    (staged address, target address, words) rows, the rows of swap i from `starts[i]`."""

    _broken: bool = False
    """The table kernel failed to build here: every exchange runs slice by slice."""

    def __init__(self, rows: torch.Tensor, starts: list[int]) -> None:
        self.rows = rows
        self.starts = starts

    @classmethod
    def of(cls, swaps: Sequence[Swap]) -> _Blocks | None:
        """None unless every swap's addresses and size are multiples of 8 bytes (and Triton
        is here)."""
        if not swaps or cls._broken or _table_kernel() is None:
            return None
        a = np.array([s.staged.data_ptr() for s in swaps], dtype=np.int64)
        b = np.array([s.target.data_ptr() for s in swaps], dtype=np.int64)
        words = np.array([s.nbytes for s in swaps], dtype=np.int64)
        if (a % 8).any() or (b % 8).any() or (words % 8).any():
            return None
        words //= 8
        counts = -(-words // _TABLE_BLOCK)
        owner = np.repeat(np.arange(len(swaps)), counts)
        first = np.concatenate([[0], np.cumsum(counts)])
        k = np.arange(int(first[-1])) - first[owner]  # the block's index within its swap
        step = 8 * _TABLE_BLOCK
        rows = np.stack(
            [
                a[owner] + step * k,
                b[owner] + step * k,
                np.minimum(words[owner] - _TABLE_BLOCK * k, _TABLE_BLOCK),
            ],
            axis=1,
        )
        device = swaps[0].staged.device
        return cls(torch.from_numpy(np.ascontiguousarray(rows)).to(device), first.tolist())

    def launch(self, start: int, stop: int) -> bool:
        """Queue the exchange of swaps [start, stop) on the current stream; False when the
        kernel cannot run (nothing was queued: the caller exchanges slice by slice)."""
        lo, hi = self.starts[start], self.starts[stop]
        if hi == lo:
            return True
        if _Blocks._broken:
            return False
        try:
            _table_kernel()[(hi - lo,)](self.rows[lo:hi], BLOCK=_TABLE_BLOCK)
        except Exception:
            log.warning(
                "the exchange's table kernel failed; exchanging slice by slice", exc_info=True
            )
            _Blocks._broken = True
            return False
        return True


def _exchange(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.is_cuda:
        _swap_device(a, b)
    else:
        _swap_host(a, b)


def _swap_host(a: torch.Tensor, b: torch.Tensor) -> None:
    with torch.no_grad():
        held = a.clone()
        a.copy_(b)
        b.copy_(held)


def _word_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as the widest integers (4 or 2 bytes) that divide its size and
    address."""
    nbytes = tensor.numel() * tensor.element_size()
    flat = tensor.view(-1).view(torch.uint8)
    for dtype in (torch.int32, torch.int16):
        size = dtype.itemsize
        if nbytes % size == 0 and tensor.data_ptr() % size == 0:
            return flat.view(dtype)
    return flat


def _swap_device(a: torch.Tensor, b: torch.Tensor) -> None:
    kernel = _kernel()
    if kernel is None:
        _swap_host(a, b)
        return
    x, y = _word_view(a), _word_view(b)
    if x.dtype != y.dtype:
        _swap_host(a, b)
        return
    n = x.numel()
    if n:
        kernel[(math.ceil(n / _BLOCK),)](x, y, n, BLOCK=_BLOCK)


@functools.cache
def _kernel() -> Any:
    """The Triton exchange kernel, compiled on first use; None where Triton cannot run."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def exchange(a, b, n, BLOCK: tl.constexpr):  # noqa: N803
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        x = tl.load(a + offsets, mask=mask)
        y = tl.load(b + offsets, mask=mask)
        tl.store(a + offsets, y, mask=mask)
        tl.store(b + offsets, x, mask=mask)

    return exchange


@functools.cache
def _table_kernel() -> Any:
    """The Triton kernel over a block table (`_Blocks`); None where Triton cannot run."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def exchange_blocks(rows, BLOCK: tl.constexpr):  # noqa: N803
        row = rows + 3 * tl.program_id(0).to(tl.int64)
        a = tl.load(row).to(tl.pointer_type(tl.int64))
        b = tl.load(row + 1).to(tl.pointer_type(tl.int64))
        count = tl.load(row + 2)
        lane = tl.arange(0, BLOCK)
        mask = lane < count
        x = tl.load(a + lane, mask=mask)
        y = tl.load(b + lane, mask=mask)
        tl.store(a + lane, y, mask=mask)
        tl.store(b + lane, x, mask=mask)

    return exchange_blocks
