"""Routing replay (R3) for a mixture-of-experts model: a pass routes every token to experts
given by the request (vLLM's routed experts for the sampled tokens) instead of the router's
own top-k, or records the router's choice for Forward's ROUTED_EXPERTS.

megatron-core's routers carry a replay hook (`moe_enable_routing_replay`): per router a
`RouterReplay` that, when told to, records its top-k indices or takes given ones, the
probabilities then gathered from its own scores at those experts. A request's
routing is per token of the batch (``[num_tokens, layers * top_k]``, the last token of each
sequence no input); a pass's routers see its inputs as megatron's ``[width, rows]`` hidden
states flattened, so each pass maps between the two (`_router_order`). Padding routes to
experts 0..k-1: its outputs are never read.

Only this rank's layers are touched: a pipeline stage replays and records its own layers, and
the activation recompute of a backward pass replays the same indices as its forward (the
action stays set for the whole schedule call, which runs one microbatch).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from trainer_svc.domain import SequenceBatch
from trainer_svc.runtime.packing import PackedBatch


class RoutingReplay:
    def __init__(self, model: torch.nn.Module, top_k: int) -> None:
        """This rank's routers (its layers of the model), each choosing `top_k` experts."""
        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self._routers = [r.router_replay for r in routers]
        if not routers or any(r is None for r in self._routers):
            raise RuntimeError("routing replay needs moe_enable_routing_replay on every router")
        self.first_layer = min(int(r.layer_number) for r in routers) - 1
        self.num_layers, self.top_k = len(routers), top_k

    @contextmanager
    def replaying(self, packed: PackedBatch, part: SequenceBatch) -> Iterator[None]:
        """Within the block, the pass of `part` (laid out as `packed`) routes as
        `part.routed_experts` says; nothing changes when it holds none."""
        if part.routed_experts is None:
            yield
            return
        source = _router_order(packed, part)
        routing = part.routed_experts.reshape(part.num_tokens, -1, self.top_k)
        here = routing[np.maximum(source, 0), self.first_layer : self.first_layer + self.num_layers]
        here[source < 0] = np.arange(self.top_k)
        indices = torch.from_numpy(here).to(packed.inputs.device)  # one copy for every layer
        for layer, router in enumerate(self._routers):
            router.set_target_indices(indices[:, layer])
            router.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            yield
        finally:
            for router in self._routers:
                router.clear_router_replay_action()
                router.clear_indices()

    @contextmanager
    def recording(self, packed: PackedBatch, part: SequenceBatch) -> Iterator[list[np.ndarray]]:
        """Records the pass's routing; after the block the list holds, per token of `part`,
        ``[num_tokens, layers here, top_k]`` (rows of no input: 0)."""
        recorded: list[np.ndarray] = []
        replay = part.routed_experts is not None
        for router in self._routers:
            if not replay:
                router.set_router_replay_action(RouterReplayAction.RECORD)
        try:
            yield recorded
            source = _router_order(packed, part)
            out = np.zeros((part.num_tokens, self.num_layers, self.top_k), dtype=np.int64)
            real = source >= 0
            for layer, router in enumerate(self._routers):
                chosen = router.target_topk_idx if replay else router.get_recorded_indices()
                assert chosen is not None, "the pass ran no router"
                out[source[real], layer] = chosen.cpu().numpy()[real]
            recorded.append(out)
        finally:
            if not replay:
                for router in self._routers:
                    router.clear_router_replay_action()
                    router.clear_indices()


def _router_order(packed: PackedBatch, part: SequenceBatch) -> np.ndarray:
    """For each token the routers see, in their order, its flat index in `part` (-1:
    padding)."""
    sequence, position = packed.router_order()
    return np.where(sequence >= 0, part.offsets[np.maximum(sequence, 0)] + position, -1)
