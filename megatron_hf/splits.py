"""Which trainer layouts a model can be split into, checked before any rank starts.

Megatron-core splits attention heads, key/value groups and the MLP's hidden size over the
tensor-parallel ranks and whole layers over the pipeline stages; it accepts some impossible
splits at build time and fails only on the first step (one KV group over two TP ranks). A
mixture of experts deals whole experts out over expert-parallel ranks and splits each one's
width over expert-tensor-parallel ranks. The vocabulary is padded to a multiple of
``vocab_multiple * TP`` rows, so it always splits.
"""

from __future__ import annotations

from megatron_hf.sharding import stage_layers
from megatron_hf.spec import ModelSpec


class UnsplittableModel(ValueError):
    """The model cannot be split into the requested parallel layout."""


def trainer_layout_problems(
    spec: ModelSpec,
    *,
    tensor_parallel: int,
    pipeline_parallel: int,
    expert_parallel: int = 1,
    expert_tensor_parallel: int = 1,
) -> list[str]:
    """Every reason `spec` cannot be trained at TP=`tensor_parallel` x PP=`pipeline_parallel`
    (with EP x ETP for its experts), each naming its numbers; empty when it can."""
    tp, pp = tensor_parallel, pipeline_parallel
    problems = []
    if spec.num_attention_heads % tp:
        problems.append(
            f"{spec.num_attention_heads} attention heads do not split over tensor parallel {tp}"
        )
    if spec.num_query_groups % tp:
        problems.append(
            f"{spec.num_query_groups} key/value heads (query groups) do not split over tensor "
            f"parallel {tp}"
        )
    if spec.ffn_hidden_size % tp:
        problems.append(
            f"MLP hidden size (intermediate_size) {spec.ffn_hidden_size} does not split over "
            f"tensor parallel {tp}"
        )
    try:
        stage_layers(spec.num_layers, pp, 0)
    except ValueError as e:
        problems.append(str(e))
    return problems + _expert_problems(spec, tp, expert_parallel, expert_tensor_parallel)


def _expert_problems(spec: ModelSpec, tp: int, ep: int, etp: int) -> list[str]:
    """Experts are dealt out whole over EP ranks and each one's width split over ETP ranks
    (under TP > 1 the trainer runs the model sequence-parallel, as megatron's expert layers
    need)."""
    if spec.moe is None:
        if ep > 1 or etp > 1:
            return [f"a dense model has no experts to split over EP {ep} x ETP {etp}"]
        return []
    problems = []
    if tp > 1 and ep == 1 and etp < tp:
        # megatron reduces the gradients of experts outside an expert-parallel layout over the
        # data-parallel ranks only, so copies on several TP ranks would drift apart.
        problems.append(
            f"mixture-of-experts layers at tensor parallel {tp} need expert parallel > 1 or "
            f"expert tensor parallel {tp}: with EP 1 and ETP {etp} every TP rank would hold "
            "every expert whole, and their gradients would not be added over the TP ranks"
        )
    if spec.moe.num_experts % ep:
        problems.append(f"{spec.moe.num_experts} experts do not split over expert parallel {ep}")
    if spec.moe.ffn_hidden_size % etp:
        problems.append(
            f"expert width (moe_intermediate_size) {spec.moe.ffn_hidden_size} does not split "
            f"over expert tensor parallel {etp}"
        )
    return problems


def check_trainer_layout(
    spec: ModelSpec,
    *,
    tensor_parallel: int,
    pipeline_parallel: int,
    expert_parallel: int = 1,
    expert_tensor_parallel: int = 1,
) -> None:
    """Raise `UnsplittableModel` listing every problem of `trainer_layout_problems`."""
    problems = trainer_layout_problems(
        spec,
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
        expert_parallel=expert_parallel,
        expert_tensor_parallel=expert_tensor_parallel,
    )
    if problems:
        experts = (
            f" EP={expert_parallel} ETP={expert_tensor_parallel}"
            if expert_parallel * expert_tensor_parallel > 1
            else ""
        )
        raise UnsplittableModel(
            f"the model cannot be trained at TP={tensor_parallel} PP={pipeline_parallel}"
            f"{experts}: " + "; ".join(problems)
        )
