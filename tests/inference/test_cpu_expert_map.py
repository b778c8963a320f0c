"""vLLM-CPU's unquantized experts kernel under expert parallelism (`inference_ext.cpu_expert_map`):
the router's global expert ids become this worker's local slots, and another worker's experts
add nothing here. The fidelity matrix's expert-parallel engine computes the trainer's logprobs
through it (tests/inference/test_fidelity_matrix.py)."""

from __future__ import annotations

import torch

from inference_ext import cpu_expert_map


def test_global_ids_become_local_slots_and_foreign_experts_weigh_nothing() -> None:
    # Worker 1 of 2 over 4 experts holds experts 2 and 3 in its slots 0 and 1.
    expert_map = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)
    ids = torch.tensor([[0, 2], [3, 1], [2, 3]], dtype=torch.int32)
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    local, weighted, foreign = cpu_expert_map.local_routing(ids, weights, expert_map)
    assert local.dtype == ids.dtype
    assert local.tolist() == [[0, 0], [1, 0], [0, 1]]
    assert torch.equal(weighted, torch.tensor([[0.0, 0.4], [0.7, 0.0], [0.5, 0.5]]))
    assert foreign.tolist() == [[True, False], [False, True], [False, False]]


def test_the_kernel_is_wrapped_once() -> None:
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    assert cpu_expert_map.install()
    wrapped = CPUUnquantizedExperts.apply
    assert cpu_expert_map.install()
    assert CPUUnquantizedExperts.apply is wrapped


def test_the_wrapped_kernel_sees_local_slots_and_zeroes_rows_routed_elsewhere() -> None:
    """What vLLM's kernel is handed: local slots, foreign weights zeroed, no map; with the
    router's weight on the input (top-1), rows whose expert lives on another worker come out
    zero. The pass itself runs in the fidelity matrix's expert-parallel engine."""
    seen: dict[str, object] = {}

    def kernel(self: object, **kwargs: object) -> None:
        seen.update(kwargs)
        kwargs["output"].fill_(1.0)  # type: ignore[union-attr]

    output = torch.zeros(2, 4)
    cpu_expert_map._wrap(kernel)(
        None,
        output=output,
        topk_ids=torch.tensor([[0], [1]], dtype=torch.int32),
        topk_weights=torch.tensor([[1.0], [1.0]]),
        expert_map=torch.tensor([-1, 0], dtype=torch.int32),
        apply_router_weight_on_input=True,
    )
    assert seen["expert_map"] is None
    assert seen["topk_ids"].tolist() == [[0], [0]]  # type: ignore[union-attr]
    assert seen["topk_weights"].tolist() == [[0.0], [1.0]]  # type: ignore[union-attr]
    assert output.tolist() == [[0.0] * 4, [1.0] * 4]  # row 0's expert is another worker's
    untouched: dict[str, object] = {}
    cpu_expert_map._wrap(lambda self, **kw: untouched.update(kw))(None, expert_map=None, x=1)
    assert untouched == {"expert_map": None, "x": 1}  # no map: handed over as it came
