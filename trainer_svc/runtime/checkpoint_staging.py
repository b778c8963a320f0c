"""A checkpoint load reads into staging tensors, never into the live state.

megatron's `dist_checkpointing.load` reads every ShardedTensor into its `data`, and the
sharded state dicts of the model and the optimizer hold the live parameters and optimizer
state there: a read that failed part-way, or on one rank only, would leave a mix of two
versions. `stage` gives each ShardedTensor and ShardedTensorFactory a fresh tensor of the same
shape and dtype instead, filled with NaN. After the read each rank checks its own part
(`Staging.check`): every tensor is there, of the live tensor's shape and dtype, and finite, so
a region that no stored chunk covered (still NaN) is refused like a non-finite value read;
megatron zero-fills the vocabulary's tensors instead, whose padded rows a checkpoint saved
with another padding lacks. Only once every rank agrees (`agreement.phase`) does
`StagedState.install` copy the staged values into the live tensors, in place: the refit
snapshot slots hold the parameters' addresses. Copies between tensors of equal shapes and
dtypes cannot fail half-way for a reason in the checkpoint.

Staging lives in host memory. torch's reader loads every stored tensor into host memory and
then copies it into its target, so host staging adds no transfer: the host-to-device copy
moves from the read to `install`. Device staging would need free device memory the size of
the rank's whole training state (parameters, main parameters, both Adam moments), which a
training GPU seldom has, and would save only that one copy. The price is host memory: while
a load runs, a node holds a copy of each of its ranks' shares of the training state.

Only tensors are staged. The rest of a sharded state dict (megatron's `_extra_state`, FP8
metadata this trainer does not use; the optimizer's parameter groups, whose hyper-parameters
every step sets again; Adam's step, which the caller sets from the trainer state) is not
installed, and the bucket padding of the distributed optimizer holds no state.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedTensor,
    ShardedTensorFactory,
)

from trainer_svc.domain import FailedPrecondition
from trainer_svc.runtime.finite import all_finite

Where = tuple[Any, ...]
"""The keys and list indices that lead to a value in a (sharded) state dict."""


@dataclass(frozen=True)
class _Entry:
    where: Where
    key: str
    """The checkpoint's name of the tensor, for messages."""
    live: torch.Tensor


@dataclass(frozen=True)
class StagedState:
    """Staged tensors that every rank checked, each with the live tensor it replaces."""

    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    """(live, staged), the model's first: the distributed optimizer's float32 main parameters
    are views of the model's, and its copy goes last, as megatron's own load does it."""

    @torch.no_grad()
    def install(self) -> None:
        for live, staged in self.pairs:
            live.copy_(staged)


def _is_padding(node: dict) -> bool:
    """A bucket padding entry of the distributed optimizer's `dp_reshardable` state."""
    marker = node.get("padding")
    return isinstance(marker, LocalNonpersistentObject) and marker.obj is True


def _walk(node: Any, where: Where = ()) -> Iterator[tuple[Where, Any]]:
    if isinstance(node, dict):
        if _is_padding(node):
            return
        for key, value in node.items():
            yield from _walk(value, (*where, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _walk(value, (*where, index))
    else:
        yield where, node


def _staging_like(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor of `tensor`'s shape and dtype: NaN for floating point (what no chunk
    covers stays NaN and fails the check), zeros otherwise."""
    if tensor.is_floating_point():
        return torch.full(tensor.shape, float("nan"), dtype=tensor.dtype)
    return torch.zeros(tensor.shape, dtype=tensor.dtype)


class Staging:
    """Where a load reads to: made by `stage`, checked after the read by `check`."""

    def __init__(self, entries: list[_Entry]) -> None:
        self.entries = entries

    def check(self, loaded: dict, what: str) -> StagedState:
        """The staged tensors in `loaded` (what `dist_checkpointing.load` returned), each
        present, of its live tensor's shape and dtype and finite; else FailedPrecondition
        naming `what` (the checkpoint) and the tensor."""
        pairs = []
        for entry in self.entries:
            value = _lookup(loaded, entry.where)
            if not isinstance(value, torch.Tensor):
                raise FailedPrecondition(f"{what} holds no data for {entry.key}")
            if value.shape != entry.live.shape or value.dtype != entry.live.dtype:
                raise FailedPrecondition(
                    f"{what}: {entry.key} was read as {value.dtype} {tuple(value.shape)}, this "
                    f"model needs {entry.live.dtype} {tuple(entry.live.shape)}"
                )
            if value.is_floating_point() and not all_finite([value]):
                raise FailedPrecondition(
                    f"{what}: {entry.key} holds values that are not finite, or parts that no "
                    "stored chunk covers"
                )
            pairs.append((entry.live, value))
        return StagedState(pairs)


def stage(sharded: dict) -> Staging:
    """Replaces, in `sharded` itself, the data of every ShardedTensor and ShardedTensorFactory
    by a staging tensor (`_staging_like`), and remembers the live tensor each replaced."""
    entries = []
    for where, value in _walk(sharded):
        if not isinstance(value, ShardedTensor | ShardedTensorFactory) or value.data is None:
            continue
        live = value.data
        value.data = _staging_like(live)
        entries.append(_Entry(where, value.key, live))
    return Staging(entries)


def _lookup(node: Any, where: Where) -> Any:
    for step in where:
        try:
            node = node[step]
        except (KeyError, IndexError, TypeError):
            return None
    return node
