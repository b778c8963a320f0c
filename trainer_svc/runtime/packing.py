"""Splits a ragged batch across data-parallel ranks and lays it out as model inputs.

Two layouts of a pass's sequences, each sequence of length L giving inputs (its tokens
0..L-2) and targets (tokens 1..L-1), so position p predicts token p+1:

- padded: row i is sequence i, right-padded to the longest. Under a causal mask padding
  leaves every real position's result unchanged, but it is computed all the same.
- packed: one row of all the sequences back to back (`runtime/documents.py`), positions
  restarting at 0 for each, attention kept inside each. No padding is computed; every
  per-token result equals the padded layout's.

Per-position arrays (loss mask, advantages, ...) follow the same layout, so the loss sees
``[rows, positions]`` either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainer_svc.domain import SequenceBatch
from trainer_svc.runtime.documents import DocumentBounds, bounds
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
    """Predicted positions per sequence (sequence length - 1)."""
    documents: DocumentBounds | None = None
    """Set for the packed layout: where each sequence lies in the one row."""
    shard: tuple[int, int] = (0, 1)
    """(rank, ranks) of a sequence-parallel model's TP group: the routers of this rank see
    its part of the positions only."""

    @property
    def rows(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def width(self) -> int:
        return int(self.inputs.shape[1])

    def router_order(self) -> tuple[np.ndarray, np.ndarray]:
        """For each input position in the order megatron's routers see them (hidden states
        ``[width, rows]`` flattened, columns outermost; sequence-parallel, this rank's part of
        the columns): its sequence and its position in that sequence, both -1 for padding."""
        sequence = np.full((self.rows, self.width), -1, dtype=np.int64)
        position = np.full((self.rows, self.width), -1, dtype=np.int64)
        flat_sequence, flat_position = sequence.reshape(-1), position.reshape(-1)
        cursor = 0
        for index, count in enumerate(self.target_counts.tolist()):
            begin = cursor if self.documents is not None else index * self.width
            flat_sequence[begin : begin + count] = index
            flat_position[begin : begin + count] = np.arange(count)
            cursor += count
        rank, ranks = self.shard
        part = self.width // ranks * self.rows
        mine = slice(rank * part, (rank + 1) * part)
        return sequence.T.reshape(-1)[mine], position.T.reshape(-1)[mine]

    def per_token(self, values: np.ndarray, batch: SequenceBatch) -> np.ndarray:
        """Inverse of the layout: ``[rows, width, ...]`` -> a per-token array of `batch`, 0 at
        each sequence's first token (nothing predicts it)."""
        out = np.zeros((batch.num_tokens, *values.shape[2:]), dtype=values.dtype)
        flat = values.reshape(-1, *values.shape[2:])
        for source, target in zip(self._slots(batch), _target_ranges(batch), strict=True):
            out[target] = flat[source]
        return out

    def _slots(self, batch: SequenceBatch) -> list[slice]:
        """Where each sequence's predicted positions lie in the flattened layout."""
        counts = batch.lengths() - 1
        if self.documents is None:
            return [slice(i * self.width, i * self.width + int(c)) for i, c in enumerate(counts)]
        starts = np.concatenate([[0], np.cumsum(counts)])
        return [slice(int(a), int(a + c)) for a, c in zip(starts[:-1], counts, strict=True)]


def _target_ranges(batch: SequenceBatch) -> list[slice]:
    """Each sequence's tokens 1..L-1 in the batch's per-token arrays (what it predicts)."""
    return [
        slice(int(start) + 1, int(end))
        for start, end in zip(batch.offsets[:-1], batch.offsets[1:], strict=True)
    ]


def _input_ranges(batch: SequenceBatch) -> list[slice]:
    """Each sequence's tokens 0..L-2 (what it reads)."""
    return [
        slice(int(start), int(end) - 1)
        for start, end in zip(batch.offsets[:-1], batch.offsets[1:], strict=True)
    ]


def _layout(
    values: np.ndarray | None, ranges: list[slice], shape: tuple[int, int], packed: bool
) -> np.ndarray | None:
    """Per-token `values` taken at `ranges` (one per sequence) into the layout's ``[rows,
    width]``: row i from column 0 when padded, back to back in row 0 when packed. None stays
    None."""
    if values is None:
        return None
    out = np.zeros(shape, dtype=values.dtype)
    flat = out.reshape(-1)
    cursor = 0
    for row, taken in enumerate(ranges):
        count = taken.stop - taken.start
        begin = cursor if packed else row * shape[1]
        flat[begin : begin + count] = values[taken]
        cursor += count
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


def pack(
    batch: SequenceBatch,
    device: torch.device,
    *,
    packed: bool = False,
    shard: tuple[int, int] = (0, 1),
) -> PackedBatch | None:
    """The pass's model inputs in the padded layout, or the packed one when `packed`. None
    when the batch has no position to predict (every sequence has one token). Its tensors
    reach a GPU without a host synchronization (`to_device`). `shard`: this rank's place in a
    sequence-parallel TP group, whose ranks split the positions evenly (the width is padded
    to a multiple of them)."""
    counts = batch.lengths() - 1
    total = int(counts.sum()) if len(counts) else 0
    if total == 0:
        return None
    ranks = shard[1]
    width = total if packed else int(counts.max())
    width = -(-width // ranks) * ranks
    shape = (1, width) if packed else (batch.num_sequences, width)
    targets = _target_ranges(batch)

    def laid_out(values: np.ndarray | None, dtype: torch.dtype | None = None) -> Any:
        arranged = _layout(values, targets, shape, packed)
        return None if arranged is None else to_device(arranged, device, dtype)

    mask = (
        batch.loss_mask if batch.loss_mask is not None else np.zeros(batch.num_tokens, dtype=bool)
    )
    # Every token carries its sequence's count of trained targets and its sequence's number,
    # for per-sequence means.
    trained = np.zeros(batch.num_tokens, dtype=np.float32)
    number = np.zeros(batch.num_tokens, dtype=np.int64)
    for index, taken in enumerate(targets):
        trained[taken] = np.count_nonzero(mask[taken])
        number[taken] = index
    token_inputs = TokenInputs(
        mask=laid_out(mask),
        advantages=laid_out(batch.advantages, torch.float32),
        behaviour_logprobs=laid_out(batch.behaviour_logprobs, torch.float32),
        reference_logprobs=laid_out(batch.reference_logprobs, torch.float32),
        sampler_logprobs=laid_out(batch.sampler_logprobs, torch.float32),
        sequence_tokens=laid_out(trained),
        sequence_index=laid_out(number),
        sequences=batch.num_sequences,
    )
    documents = None
    if packed:
        lengths = [int(c) for c in counts if c > 0]
        if width > total:  # a document of padding, attending to itself alone
            lengths.append(width - total)
        positions = to_device(np.concatenate([np.arange(c) for c in lengths])[None], device)
        cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        documents = bounds(lengths, positions[0], to_device(cu_seqlens, device))
    else:
        positions = torch.arange(shape[1], device=device).unsqueeze(0).expand(shape[0], -1)
    inputs = _layout(batch.tokens, _input_ranges(batch), shape, packed)
    assert inputs is not None
    return PackedBatch(
        inputs=to_device(inputs, device),
        targets=laid_out(batch.tokens),
        positions=positions,
        token_inputs=token_inputs,
        target_counts=counts,
        documents=documents,
        shard=shard,
    )
