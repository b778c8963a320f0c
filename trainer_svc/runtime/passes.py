"""How many tokens one forward/backward pass takes, and the cut of a larger request into passes.

A TrainMicrobatch or Forward whose share on a data-parallel rank holds more tokens than the pass
budget runs in several passes over consecutive groups of its sequences (a sequence longer than
the budget alone). Tokens are what the layout computes: every token of a packed row, and the
padding too in right-padded rows (rows times the longest), which is what memory holds.
Training passes accumulate gradients and loss sums exactly as microbatches do, so the step's
update is the same as with the groups sent as separate microbatches; Forward passes
concatenate their per-token outputs.

The budget is `--pass-token-budget` when given; otherwise it is derived once at start from the
model and the device: half of the GPU memory free after the model, optimizer and refit slots
are allocated, over an estimate of the activation memory one token costs in training (per layer
of this rank's stage: what autograd keeps of the norms (with their float32 intermediates),
projections, rotary, attention and MLP (gate, up, their product), `(10 * hidden + 4 * ffn) *
bytes`; plus two rows of this rank's vocabulary shard for the logits and their gradient),
and never above `--max-microbatch-tokens`. On the CPU the request limit is the budget. All
ranks take the smallest value, so the ranks of a model replica cut a request alike.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_hf.spec import ModelSpec


def derived_budget(
    spec: ModelSpec,
    *,
    layers: int,
    local_vocab: int,
    dtype: torch.dtype,
    device: torch.device,
    max_tokens: int,
) -> int:
    """The pass budget this rank's memory allows (see the module docs), at most `max_tokens`."""
    if device.type != "cuda":
        return max_tokens
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_layer = (10 * spec.hidden_size + 4 * spec.ffn_hidden_size) * itemsize
    per_token = max(1, layers) * per_layer + 2 * local_vocab * itemsize
    free, _ = torch.cuda.mem_get_info(device)
    return int(max(1, min(max_tokens, free // 2 // per_token)))


def split_passes(lengths: np.ndarray, budget: int, *, padded: bool = False) -> list[np.ndarray]:
    """Consecutive groups of sequence indices, each at most `budget` tokens (a longer sequence
    is a group of its own); one group when everything fits. With `padded` a group costs what
    its right-padded rows compute: its sequences times the longest of them."""
    if budget < 1:
        raise ValueError(f"the pass budget must be >= 1 token, got {budget}")
    groups: list[list[int]] = []
    tokens = longest = 0
    for index, length in enumerate(np.asarray(lengths, dtype=np.int64).tolist()):
        cost = (len(groups[-1]) + 1) * max(longest, length) if padded and groups else length
        if not groups or (cost if padded else tokens + length) > budget:
            groups.append([])
            tokens = longest = 0
        groups[-1].append(index)
        tokens += length
        longest = max(longest, length)
    return [np.array(g, dtype=np.int64) for g in groups] or [np.zeros(0, dtype=np.int64)]
