"""Engine tensors that live in staging: a refit pulls straight into the tensors the engine
computes with, and a backup taken off the refit's path restores them when a refit fails.

Without it, a refit copies staging into the engine's tensors once the pull is over and checked: a
device-local copy of every byte after the last one landed. With it (`Receiver.fetch(version,
in_place=...)`, the engine's tensors by HF name), each tensor whose slice lies in staging exactly as
the engine holds it (contiguous, the same shape, dtype and device, the whole tensor) is **adopted**
once: after the first refit of a layout installs it the usual way, the tensor is pointed at its
slice of staging (`tensor.data = view`), and the engine's own copy is freed. From the next refit of
that layout on, the pull lands in the engine's tensors themselves. A tensor the engine holds in
another dtype than the trainer (Megatron's fp32 norm weights in a bf16 model) cannot live in
staging; the receiver casts those in itself after the check. Staged in the slot's order, their
slices lie together (a trainer rank's fp32 parameters are a buffer of their own, laid out first), so
at adoption they get storage in one **cast arena** laid out as their slices are, and each install
casts the whole span in one copy (37 small tensors of the 1B Llama: one kernel instead of one per
tensor); others are cast in one `_foreach_copy_`. Only the slices assembled from several reads still
go to the installer.

Bytes landing in the engine's tensors before the whole version is checked would leave it
half-loaded when the refit fails. So after each install a **backup** of staging is copied on a
stream of its own, while the trainer computes its next step (a device-local copy of the
model's bytes, off the refit's path; the next pull waits for it, long done by then), and a refit
that fails once its pull has begun copies it back (`restore`): the engine is on its old
version again, bit for bit. Memory: staging plus the backup, the size of the engine's own
tensors plus staging that a refit by copy holds anyway.

A fetch of another layout (or with another staging buffer) first gives the adopted tensors
storage of their own again (`release`), so the new layout's bytes never land in them until
its first install adopts them anew. An engine must adopt before capturing anything that holds
its tensors' addresses (CUDA graphs): adoption moves them, later refits do not.

Once adopted, staging holds the installed version, so `Receiver.slices` reads it as before.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


ARENA_SLACK = 2
"""A cast arena may span up to this many times its tensors' bytes (alignment gaps between
their slices, converted for nothing); a group of slices spread wider is cast tensor by tensor."""


@dataclass(frozen=True)
class CastSpan:
    """Cast tensors living in one arena laid out as their staged slices are: `arena` (the
    targets' dtype) takes `source` (their span of staging, in the slices' dtype) in one copy."""

    source: torch.Tensor
    arena: torch.Tensor


@dataclass(frozen=True)
class Adoptable:
    """One slice's staged view and the engine tensor that can live there."""

    name: str
    view: torch.Tensor
    target: torch.Tensor


def castable(view: torch.Tensor, target: torch.Tensor | None) -> bool:
    """Whether the receiver can copy `view` into `target` itself: the same shape and device
    (a dtype the copy casts to)."""
    return target is not None and target.shape == view.shape and target.device == view.device


def adoptable(view: torch.Tensor, target: torch.Tensor | None) -> bool:
    """Whether `target` can live at `view`: the same shape, dtype and device, both
    contiguous."""
    return (
        target is not None
        and target.shape == view.shape
        and target.dtype == view.dtype
        and target.device == view.device
        and target.is_contiguous()
        and view.is_contiguous()
    )


class InPlace:
    """The engine tensors a receiver's staging holds, and their backup."""

    def __init__(self) -> None:
        self.key: tuple[Any, ...] | None = None
        """What the adopted tensors were laid out for (plan, staging buffer, targets)."""
        self.adopted: dict[str, torch.Tensor] = {}
        """The engine's tensors living in staging, by HF name."""
        self.cast: dict[str, Adoptable] = {}
        """The engine's tensors the receiver casts its staged slices into, by HF name."""
        self.spans: list[CastSpan] = []
        """The cast tensors living in arenas (each cast in one copy)."""
        self._loose: list[Adoptable] = []
        """The cast tensors cast one by one (in one `_foreach_copy_`)."""
        self._held: Any = None
        """The targets mapping and the plan the key names by id (kept alive with it)."""
        self._staging: torch.Tensor | None = None
        """The bytes of staging the adopted tensors lie in (what the backup copies)."""
        self._backup: torch.Tensor | None = None
        self._backed_up: Any = None
        """The backup's copy, queued (a CUDA event), or None once waited for."""
        self._stream: Any = None
        self.armed = False
        """A pull into the adopted tensors has begun: a failure restores the backup."""
        self._nbytes = 0
        self.names: frozenset[str] = frozenset()
        """The adopted and cast tensors' names: what a pull into staging fills for them."""

    @property
    def nbytes(self) -> int:
        """Bytes of the adopted tensors."""
        return self._nbytes

    def prepare(self, key: tuple[Any, ...]) -> bool:
        """Before a pull of layout `key` into staging: True when the engine's tensors live
        there (the pull fills them; a failure must `restore`); when they live in another
        layout's staging they get storage of their own first (`release`)."""
        if self.key is not None and self.key != key:
            self.release()
        if self.key is None:
            return False
        if self._backed_up is not None:
            self._backed_up.synchronize()
            self._backed_up = None
        self.armed = True
        return True

    def adopt(
        self,
        key: tuple[Any, ...],
        candidates: list[Adoptable],
        staging: torch.Tensor,
        held: Any,
        cast: Sequence[Adoptable] = (),
    ) -> None:
        """After an install of layout `key` (the engine's tensors and staging hold the same
        version): point every candidate at its view of `staging`, keep the `cast` slices for
        `cast_in`, and back staging up."""
        self.release()
        for slot in candidates:
            with torch.no_grad():
                slot.target.data = slot.view
            self.adopted[slot.name] = slot.target
        self.cast = {slot.name: slot for slot in cast}
        self.spans, self._loose = _arenas(cast, staging)
        self.key, self._held, self._staging = key, held, staging
        self._nbytes = sum(t.numel() * t.element_size() for t in self.adopted.values())
        self.names = frozenset([*self.adopted, *self.cast])
        if (
            self._backup is None
            or self._backup.shape != staging.shape
            or (self._backup.device != staging.device)
        ):
            self._backup = torch.empty_like(staging)
        log.info(
            "%d engine tensors (%d bytes) now live in staging; %d cast in, %d of them from "
            "%d arenas",
            len(self.adopted),
            self.nbytes,
            len(self.cast),
            len(self.cast) - len(self._loose),
            len(self.spans),
        )
        self.back_up()

    def cast_in(self) -> None:
        """Copy the staged slices of the cast tensors into them: one copy per arena, the rest
        in one `_foreach_copy_` (queued on the current stream on a GPU). Gathering them per
        pair of dtypes into a buffer, casting once and copying out in one multi-tensor copy,
        with the views built on every install, was measured slower."""
        with torch.no_grad():
            for span in self.spans:
                span.arena.copy_(span.source, non_blocking=True)
            if self._loose:
                torch._foreach_copy_(
                    [s.target for s in self._loose],
                    [s.view for s in self._loose],
                    non_blocking=True,
                )

    def back_up(self) -> None:
        """Copy staging (the version just installed) into the backup, on a stream of its own
        behind the work queued so far; the next pull waits for it."""
        assert self._staging is not None and self._backup is not None
        self.armed = False
        if self._staging.device.type != "cuda":
            self._backup.copy_(self._staging)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self._staging.device)
        self._stream.wait_stream(torch.cuda.current_stream(self._staging.device))
        with torch.cuda.stream(self._stream):
            self._backup.copy_(self._staging, non_blocking=True)
            self._backed_up = torch.cuda.Event()
            self._backed_up.record()

    def restore(self) -> None:
        """A refit failed after its pull began: staging, and with it the engine's tensors, get
        the last installed version back from the backup."""
        if not self.armed:
            return
        assert self._staging is not None and self._backup is not None
        self.armed = False
        device = self._staging.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the checks and copies still queued on the bytes
        self._staging.copy_(self._backup)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        log.info("restored %d engine tensors from the backup", len(self.adopted))

    def release(self) -> None:
        """Give the adopted tensors storage of their own again (a copy of what they hold)."""
        if self.armed:
            self.restore()
        for tensor in self.adopted.values():
            with torch.no_grad():
                tensor.data = tensor.data.clone()
        if self.adopted:
            log.info("%d engine tensors left staging", len(self.adopted))
        self.adopted = {}
        self.cast = {}
        self.spans, self._loose = [], []  # the arenas stay the cast tensors' storage
        self.names = frozenset()
        self._nbytes = 0
        self.key = self._held = self._staging = None
        self._backed_up = None

    def close(self) -> None:
        """The receiver goes: the engine keeps its tensors, with storage of their own."""
        self.release()
        self._backup = None


def candidates(
    views: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor]
) -> tuple[list[Adoptable], list[Adoptable]]:
    """The slices (HF name → staged view) that `targets` can live at (`adoptable`), and the
    others that the receiver can cast into them (`castable`)."""
    live, cast = [], []
    for name, view in views.items():
        target = targets.get(name)
        if adoptable(view, target):
            live.append(Adoptable(name, view, targets[name]))
        elif castable(view, target):
            cast.append(Adoptable(name, view, targets[name]))
    return live, cast


def _arenas(
    cast: Sequence[Adoptable], staging: torch.Tensor
) -> tuple[list[CastSpan], list[Adoptable]]:
    """Per pair of dtypes, the cast slices lying in `staging` (contiguous, aligned to their
    element, none overlapping another) within `ARENA_SLACK` times their bytes: their targets
    get storage in an arena laid out as the slices are (holding the values they held), cast
    in one copy. The others, cast one by one."""
    groups: dict[tuple[torch.dtype, torch.dtype], list[tuple[int, Adoptable]]] = {}
    loose: list[Adoptable] = []
    base, end = staging.data_ptr(), staging.data_ptr() + staging.numel() * staging.element_size()
    for slot in cast:
        view, at = slot.view, slot.view.data_ptr() - base
        nbytes = view.numel() * view.element_size()
        if (
            view.device != staging.device
            or not view.is_contiguous()
            or not slot.target.is_contiguous()
            or at < 0
            or base + at + nbytes > end
            or at % view.element_size()
        ):
            loose.append(slot)
        else:
            groups.setdefault((view.dtype, slot.target.dtype), []).append((at, slot))
    spans = []
    for (source_dtype, target_dtype), members in groups.items():
        item = torch.empty((), dtype=source_dtype).element_size()
        lo = min(at for at, _ in members)
        hi = max(at + s.view.numel() * item for at, s in members)
        members.sort(key=lambda member: member[0])
        ends = [at + s.view.numel() * item for at, s in members]
        overlap = any(members[i + 1][0] < ends[i] for i in range(len(members) - 1))
        held = sum(s.view.numel() * item for _, s in members)
        if len(members) < 2 or overlap or hi - lo > ARENA_SLACK * held:
            loose.extend(s for _, s in members)
            continue
        flat = staging.view(torch.uint8).view(-1)
        source = flat[lo:hi].view(source_dtype)
        arena = torch.empty(source.numel(), dtype=target_dtype, device=staging.device)
        with torch.no_grad():
            for at, slot in members:
                first = (at - lo) // item
                home = arena[first : first + slot.view.numel()].view(slot.target.shape)
                home.copy_(slot.target)
                slot.target.data = home
        spans.append(CastSpan(source, arena))
    return spans, loose
