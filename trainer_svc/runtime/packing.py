"""Splits a ragged batch across data-parallel ranks and packs it into right-padded tensors.

Row i of a packed batch is one sequence of length L: inputs are its tokens 0..L-2, targets its
tokens 1..L-1, so position p predicts token p+1. Right padding under a causal mask leaves every
real position's result unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainer_svc.domain import SequenceBatch
from trainer_svc.runtime.losses import TokenInputs


def assign_to_data_parallel(lengths: np.ndarray, dp_size: int) -> list[np.ndarray]:
    """Sequence indices per DP rank, balanced by token count (longest first to the least loaded
    rank), each list in request order. Deterministic, so every rank computes the same split."""
    loads = np.zeros(dp_size, dtype=np.int64)
    owner = np.empty(len(lengths), dtype=np.int64)
    for index in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
        rank = int(np.argmin(loads))
        owner[index] = rank
        loads[rank] += lengths[index]
    return [np.flatnonzero(owner == rank) for rank in range(dp_size)]


@dataclass
class PackedBatch:
    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor
    token_inputs: TokenInputs
    target_counts: np.ndarray
    """Predicted positions per row (sequence length - 1)."""

    @property
    def rows(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def width(self) -> int:
        return int(self.inputs.shape[1])


def _per_position(values: np.ndarray | None, batch: SequenceBatch, width: int) -> np.ndarray | None:
    """A per-token array as [rows, width] target positions (token j -> position j-1)."""
    if values is None:
        return None
    out = np.zeros((batch.num_sequences, width), dtype=values.dtype)
    for row, (start, end) in enumerate(zip(batch.offsets[:-1], batch.offsets[1:], strict=True)):
        out[row, : end - start - 1] = values[start + 1 : end]
    return out


def to_device(values: np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    """A host array on `device`. To a GPU through pinned memory and without waiting: a copy
    from pageable memory waits for every kernel queued before it, so the next microbatch
    could not be launched while this one runs (the caching host allocator keeps the pinned
    block until the copy is done)."""
    host = torch.from_numpy(np.ascontiguousarray(values))
    if dtype is not None:
        host = host.to(dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def pack(batch: SequenceBatch, device: torch.device) -> PackedBatch | None:
    """None when the batch has no position to predict (every sequence has one token). Its
    tensors reach a GPU without a host synchronization (`to_device`)."""
    counts = batch.lengths() - 1
    width = int(counts.max()) if len(counts) else 0
    if width == 0:
        return None
    inputs = np.zeros((batch.num_sequences, width), dtype=np.int64)
    targets = np.zeros((batch.num_sequences, width), dtype=np.int64)
    for row, (start, end) in enumerate(zip(batch.offsets[:-1], batch.offsets[1:], strict=True)):
        inputs[row, : end - start - 1] = batch.tokens[start : end - 1]
        targets[row, : end - start - 1] = batch.tokens[start + 1 : end]

    def tensor(values: np.ndarray | None, dtype: torch.dtype) -> torch.Tensor | None:
        return None if values is None else to_device(values, device, dtype)

    mask = _per_position(batch.loss_mask, batch, width)
    token_inputs = TokenInputs(
        mask=to_device(mask if mask is not None else np.zeros_like(inputs, dtype=bool), device),
        advantages=tensor(_per_position(batch.advantages, batch, width), torch.float32),
        behaviour_logprobs=tensor(
            _per_position(batch.behaviour_logprobs, batch, width), torch.float32
        ),
        reference_logprobs=tensor(
            _per_position(batch.reference_logprobs, batch, width), torch.float32
        ),
    )
    positions = torch.arange(width, device=device).unsqueeze(0).expand(batch.num_sequences, -1)
    return PackedBatch(
        inputs=to_device(inputs, device),
        targets=to_device(targets, device),
        positions=positions,
        token_inputs=token_inputs,
        target_counts=counts,
    )


def unpack_per_token(rows: np.ndarray, batch: SequenceBatch) -> np.ndarray:
    """Inverse of the position layout: [rows, width, ...] -> per-token array, 0 at first tokens."""
    out = np.zeros((batch.num_tokens, *rows.shape[2:]), dtype=rows.dtype)
    for row, (start, end) in enumerate(zip(batch.offsets[:-1], batch.offsets[1:], strict=True)):
        out[start + 1 : end] = rows[row, : end - start - 1]
    return out
