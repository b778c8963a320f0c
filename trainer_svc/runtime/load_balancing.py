"""The mixture-of-experts load-balancing loss, per sequence, so that a split step keeps it.

megatron's Switch-style loss, coeff * E * sum_i f_i * P_i (f_i the fraction of routed tokens
that chose expert i, P_i its mean router probability), is taken over each pass's tokens: how a
step's sequences fall into microbatches and passes would change it, and a batch streamed in k
pieces would no longer equal the batch sent whole. Here the same loss is taken over each
sequence alone and weighted by its tokens,

    coeff * sum_s T_s * E * sum_i f_i(s) * P_i(s) = coeff * E / k * sum_s sum_i c_i(s) * P_i(s)

(c_i(s) the sequence's tokens routed to expert i, a constant as in megatron; k the top-k), a
sum over sequences that the step's 1/N normalization divides like the policy loss. Padding
takes no part. megatron's own loss stays off (`moe_router_load_balancing_type="none"`); a
forward hook on each router attaches this one through megatron's `MoEAuxLossAutoScaler`, the
way megatron attaches its own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.moe.router import TopKRouter

from trainer_svc.runtime.packing import PackedBatch


def sequence_ids(batch: PackedBatch) -> torch.Tensor:
    """The sequence each input position belongs to (-1: padding), in the routers' token order:
    megatron's hidden states are [width, rows], flattened width-major."""
    ids = np.full((batch.rows, batch.width), -1, dtype=np.int64)
    flat = ids.reshape(-1)
    cursor = 0
    for index, count in enumerate(batch.target_counts.tolist()):
        begin = cursor if batch.documents is not None else index * batch.width
        flat[begin : begin + count] = index
        cursor += count
    return torch.from_numpy(np.ascontiguousarray(ids.T).reshape(-1))


def per_sequence_loss(
    logits: torch.Tensor, routing_map: torch.Tensor, ids: torch.Tensor, top_k: int, coeff: float
) -> torch.Tensor:
    """coeff * E / k * sum_s sum_i c_i(s) * P_i(s) over the routed tokens `logits` [T, E]
    (fp32), `routing_map` [T, E] and their sequence ids [T] (-1 ignored)."""
    experts = logits.shape[-1]
    real = ids >= 0
    seq = ids[real]
    sequences = int(seq.max()) + 1 if len(seq) else 0
    probs = torch.softmax(logits[real].float(), dim=-1)
    chosen = routing_map[real].to(probs.dtype)
    mass = probs.new_zeros(sequences, experts).index_add_(0, seq, probs)
    counts = probs.new_zeros(sequences, experts).index_add_(0, seq, chosen)
    tokens = probs.new_zeros(sequences).index_add_(0, seq, torch.ones_like(seq, dtype=probs.dtype))
    per_sequence = (counts * mass).sum(-1) / tokens.clamp(min=1)
    return coeff * experts / top_k * per_sequence.sum()


class SequenceBalancing:
    """Attaches the per-sequence loss to every router of a model (training passes only)."""

    def __init__(self, model: torch.nn.Module, coeff: float) -> None:
        self.coeff = coeff
        self._ids: torch.Tensor | None = None
        self._logits: dict[int, torch.Tensor] = {}
        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        assert routers, "a mixture-of-experts model has a router per layer"
        for router in routers:
            router.register_forward_hook(self._attach)
            router.gating = self._gating(router, router.gating)

    def set_pass(self, batch: PackedBatch, trains: bool) -> None:
        """The pass whose tokens the routers see next; one that does not train (a forward,
        a filler pass) gets no load-balancing loss."""
        self._ids = sequence_ids(batch) if trains else None

    def _gating(self, router: TopKRouter, gating: Any) -> Any:
        """The router's gating linear, keeping its fp32 logits for the hook."""

        def keep(input: torch.Tensor) -> torch.Tensor:
            logits = gating(input)
            self._logits[id(router)] = logits
            return logits

        return keep

    def _attach(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        logits = self._logits.pop(id(module), None)
        if not torch.is_grad_enabled() or logits is None or self._ids is None:
            return output
        probs, routing_map = output
        ids = self._ids.to(logits.device)
        loss = per_sequence_loss(
            logits.reshape(-1, logits.shape[-1]),
            routing_map,
            ids,
            int(module.topk),  # type: ignore[arg-type]  # TopKRouter's int
            self.coeff,
        )
        return MoEAuxLossAutoScaler.apply(probs, loss), routing_map
