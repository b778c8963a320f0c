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

The same hook keeps the step's account, on the device with no host synchronization, of what
FinishTrainStep reports for a mixture-of-experts model whether or not the loss is on: the
Switch loss per routed token (E * sum_i f_i * P_i, 1 for a router that spreads evenly; summed
here as the coefficient-free loss above, then divided by the routed tokens) and how many tokens
each layer routed to each expert. Training passes count; Forward and filler passes do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.moe.router import TopKRouter

from trainer_svc.runtime.packing import PackedBatch


def sequence_ids(batch: PackedBatch) -> torch.Tensor:
    """The sequence each input position belongs to (-1: padding), in the routers' token
    order, on the pass's device."""
    return torch.from_numpy(batch.router_order()[0]).to(batch.inputs.device)


def per_sequence_loss(
    logits: torch.Tensor,
    routing_map: torch.Tensor,
    ids: torch.Tensor,
    top_k: int,
    coeff: float,
    *,
    sequences: int,
    split: bool = False,
) -> torch.Tensor:
    """coeff * E / k * sum_s sum_i c_i(s) * P_i(s) over the routed tokens `logits` [T, E]
    (fp32), `routing_map` [T, E] and their sequence ids [T] (-1 ignored) of `sequences`.
    `split`: the tokens are this rank's part of a sequence-parallel TP group's, so the
    per-sequence sums are added over the group first (the probabilities' gradient each rank
    takes back for its own tokens), and every rank gets the whole loss."""
    experts = logits.shape[-1]
    # Padding is weighted out rather than indexed out: no host synchronization.
    real = (ids >= 0).to(torch.float32)
    seq = ids.clamp(min=0)
    probs = torch.softmax(logits.float(), dim=-1) * real[:, None]
    chosen = routing_map.to(probs.dtype) * real[:, None]
    mass = probs.new_zeros(sequences, experts).index_add_(0, seq, probs)
    counts = probs.new_zeros(sequences, experts).index_add_(0, seq, chosen)
    tokens = probs.new_zeros(sequences).index_add_(0, seq, real)
    if split:  # one all-reduce for the three (its backward passes the gradient through)
        summed = reduce_from_tensor_model_parallel_region(
            torch.cat([mass, counts, tokens[:, None]], dim=1)
        )
        mass, counts, tokens = summed[:, :experts], summed[:, experts:-1], summed[:, -1]
    per_sequence = (counts * mass).sum(-1) / tokens.clamp(min=1)
    return coeff * experts / top_k * per_sequence.sum()


@dataclass(frozen=True)
class RoutingTotals:
    """A step's routing account on this rank (device tensors; zeros for layers elsewhere)."""

    switch: torch.Tensor
    """The coefficient-free loss summed over layers and passes (float64)."""
    routed: torch.Tensor
    """Tokens routed, summed over layers and passes (float64)."""
    load: torch.Tensor
    """``[layers, experts]``: tokens each layer routed to each expert (float64)."""


class SequenceBalancing:
    """Attaches the per-sequence loss to every router of a model (training passes only, and
    only with a coefficient), and keeps the step's routing account (`RoutingTotals`)."""

    def __init__(self, model: torch.nn.Module, coeff: float, num_layers: int) -> None:
        self.coeff = coeff
        self.num_layers = num_layers
        self._ids: torch.Tensor | None = None
        self._sequences = 0
        self._shard = (0, 1)
        self._logits: dict[int, torch.Tensor] = {}
        self._totals: RoutingTotals | None = None
        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        assert routers, "a mixture-of-experts model has a router per layer"
        for router in routers:
            router.register_forward_hook(self._attach)
            router.gating = self._gating(router, router.gating)

    def set_pass(self, batch: PackedBatch, trains: bool) -> None:
        """The pass whose tokens the routers see next; one that does not train (a forward,
        a filler pass) gets no load-balancing loss and is not counted."""
        self._ids = sequence_ids(batch) if trains else None
        self._sequences = len(batch.target_counts)
        self._shard = batch.shard

    def take(self) -> RoutingTotals | None:
        """The account since the last `take` (None: nothing routed in a training pass)."""
        totals, self._totals = self._totals, None
        return totals

    def _count(
        self, module: TopKRouter, unit: torch.Tensor, routing_map: torch.Tensor, real: torch.Tensor
    ) -> None:
        """Adds a training pass's routing at one router to the step's account (`real`: which
        of its tokens are no padding)."""
        if self._totals is None:
            zeros = torch.zeros((), dtype=torch.float64, device=unit.device)
            experts = routing_map.shape[-1]
            self._totals = RoutingTotals(
                switch=zeros.clone(),
                routed=zeros.clone(),
                load=torch.zeros(
                    (self.num_layers, experts), dtype=torch.float64, device=unit.device
                ),
            )
        layer = int(module.layer_number) - 1  # set by megatron
        if self._shard[0] == 0:  # a sequence-parallel group's ranks each hold the whole loss
            self._totals.switch.add_(unit.detach().to(torch.float64))
        self._totals.routed.add_(real.sum())
        self._totals.load[layer].add_((routing_map & real[:, None]).sum(0).to(torch.float64))

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
        ids = self._ids
        unit = per_sequence_loss(
            logits.reshape(-1, logits.shape[-1]),
            routing_map,
            ids,
            int(module.topk),  # type: ignore[arg-type]  # TopKRouter's int
            1.0,
            sequences=self._sequences,
            split=self._shard[1] > 1,
        )
        assert isinstance(module, TopKRouter)
        self._count(module, unit, routing_map, ids >= 0)
        if not self.coeff:
            return output
        return MoEAuxLossAutoScaler.apply(probs, self.coeff * unit), routing_map
