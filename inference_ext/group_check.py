"""An engine's workers check together the shards none of them read whole (docs/refit.md,
"Checksums"; the arithmetic is `refit_sidecar/integrity/partial_sums.py`).

`WorkerRefit.fetch` ends with the workers' agreement over vLLM's CPU process group: only if
every worker has its bytes does any install. `agree` is that agreement with the sums of the
reads of parts of shards added up, in collectives every worker runs alike whatever it holds:

1. MIN of (has its bytes, shards in its manifest, minus that, minus whether it read part of
   any shard): every worker learns whether all are ready and whether there is anything to add;
2. then SUM of every worker's `contribution` (units read, low and high 32 bits of the sums,
   per shard of the manifest): every worker holds the group's sum of every shard;
3. then MIN of the first shard each worker finds wrong among those it read part of (only a
   reader knows a shard's published sum), so that all fail alike, naming the same shard.

2 and 3 run only when every worker is ready and some read part of a shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from refit_sidecar.integrity.partial_sums import (
    PartialSums,
    contribution,
    judge,
    mismatch_message,
)


@dataclass(frozen=True)
class Agreement:
    """What the engine's workers agreed on after their pulls (the same on every worker, but
    the counts, which are this worker's)."""

    ready: bool
    """Every worker has its bytes."""
    error: str | None = None
    """A shard read in parts whose parts' sum differs from its published WSUM-64: nothing
    may be installed."""
    verified_shards: int = 0
    """This worker's reads of parts of shards the group checked."""
    verified_bytes: int = 0
    """Their bytes."""


def agree(ready: bool, partial: PartialSums | None, group: Any) -> Agreement:
    """The agreement of the workers of `group` (a CPU process group: gloo): `ready` is this
    worker's having its bytes, `partial` the sums of its reads of parts of shards (None when
    it does not verify)."""
    shards = 0 if partial is None else partial.order.count
    some = partial is not None and len(partial) > 0
    first = torch.tensor([int(ready), shards, -shards, -int(some)], dtype=torch.int64)
    torch.distributed.all_reduce(first, op=torch.distributed.ReduceOp.MIN, group=group)
    all_ready, fewest, most, any_partial = first.tolist()
    if not all_ready:
        return Agreement(False)
    if not any_partial or fewest != -most or partial is None:
        return Agreement(True)  # nothing read in parts, or workers not verifying alike
    summed = torch.from_numpy(contribution(partial))
    torch.distributed.all_reduce(summed, op=torch.distributed.ReduceOp.SUM, group=group)
    totals = summed.numpy()
    judged = judge(partial, totals)
    wrong = torch.tensor([shards if judged.failed is None else judged.failed], dtype=torch.int64)
    torch.distributed.all_reduce(wrong, op=torch.distributed.ReduceOp.MIN, group=group)
    failed = int(wrong.item())
    if failed < shards:
        workers = torch.distributed.get_world_size(group)
        return Agreement(True, mismatch_message(partial.order, failed, totals, workers))
    return Agreement(True, None, judged.verified_shards, judged.verified_bytes)
