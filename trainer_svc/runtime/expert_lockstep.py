"""Keeps data-parallel ranks in step where their experts exchange tokens.

With expert parallelism folded over data parallelism, every expert layer of a forward or
backward pass is an all-to-all among the ranks of an expert group, which otherwise hold
different sequences and cut their shares into their own number of passes. Each such rank runs
as many model passes as the busiest one: a rank with fewer (or none) runs filler passes, a
real sequence of the request with its loss mask cleared, whose loss is scaled to zero and
whose outputs are dropped. Dense models and layouts without an expert grid never pay for this.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist

from trainer_svc.domain import SequenceBatch
from trainer_svc.runtime.topology import Topology


def coupled(topology: Topology) -> bool:
    """Whether this rank's passes must match its data-parallel peers' one for one."""
    layout = topology.layout
    return layout.has_expert_grid and layout.data_parallel > 1


def live(part: SequenceBatch) -> bool:
    """Whether a pass runs the model at all (`packing.pack` skips one with nothing to predict)."""
    return bool(part.num_sequences) and int((part.lengths() - 1).sum()) > 0


def most_passes(count: int, topology: Topology) -> int:
    """The largest number of live passes any rank runs for this command (collective over
    every rank; the stages of a replica agree anyway)."""
    total = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(total, op=dist.ReduceOp.MAX, group=topology.control_group)
    return int(total[0])


def filler(batch: SequenceBatch) -> SequenceBatch:
    """A pass that trains nothing: the request's first sequence with something to predict,
    its loss mask cleared. Only asked for when some rank has a live pass, so one exists."""
    lengths = batch.lengths()
    (candidates,) = np.nonzero(lengths > 1)
    assert len(candidates), "no sequence to predict, so no rank runs a pass"
    one = batch.select(candidates[:1])
    return dataclasses.replace(one, loss_mask=np.zeros(one.num_tokens, dtype=bool))


def aligned(
    parts: list[SequenceBatch], request: SequenceBatch, topology: Topology
) -> list[tuple[SequenceBatch, bool]]:
    """This rank's passes, each with True, then filler passes (False) until it runs the model
    as often as the busiest peer (passes with nothing to predict run none); the parts alone
    where ranks are not coupled."""
    own = [(part, True) for part in parts]
    if not coupled(topology):
        return own
    runs = sum(live(part) for part in parts)
    extra = most_passes(runs, topology) - runs
    return own + [(filler(request), False)] * extra
