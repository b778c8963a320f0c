"""Which trainer layouts a model can be split into, checked before any rank starts.

Megatron-core splits attention heads, key/value groups and the MLP's hidden size over the
tensor-parallel ranks and whole layers over the pipeline stages; it accepts some impossible
splits at build time and fails only on the first step (one KV group over two TP ranks). The
vocabulary is padded to a multiple of ``vocab_multiple * TP`` rows, so it always splits.
"""

from __future__ import annotations

from megatron_hf.sharding import stage_layers
from megatron_hf.spec import ModelSpec


class UnsplittableModel(ValueError):
    """The model cannot be split into the requested parallel layout."""


def trainer_layout_problems(
    spec: ModelSpec, *, tensor_parallel: int, pipeline_parallel: int
) -> list[str]:
    """Every reason `spec` cannot be trained at TP=`tensor_parallel` x PP=`pipeline_parallel`,
    each naming its numbers; empty when it can."""
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
    return problems


def check_trainer_layout(spec: ModelSpec, *, tensor_parallel: int, pipeline_parallel: int) -> None:
    """Raise `UnsplittableModel` listing every problem of `trainer_layout_problems`."""
    problems = trainer_layout_problems(
        spec, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel
    )
    if problems:
        raise UnsplittableModel(
            f"the model cannot be trained at TP={tensor_parallel} PP={pipeline_parallel}: "
            + "; ".join(problems)
        )
