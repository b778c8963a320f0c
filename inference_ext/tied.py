"""Tied word embeddings in a vLLM model: the LM head that shares the input embedding's weight.

A tied model's checkpoint has no ``lm_head.weight``; vLLM's loader skips that name and the LM
head's ``weight`` *is* the embedding's parameter. vLLM's in-place reload rebuilds and
post-processes only the layers it was given tensors for, so after a refit the shared parameter
holds the new embedding, but the LM head's own post-load state does not: on CPU its
``process_weights_after_loading`` packed a private copy of the weight for the GEMM kernel
(``cpu_linear``), and logits would keep coming from the old weights. After every reload that
included the embedding, `refresh_tied_heads` reruns that one processing step for the tied
heads and for nothing else (on GPU the step is a no-op for unquantized heads).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def tied_heads(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The LM heads of `model` whose weight is an input embedding's parameter (the same
    tensor object), in module order."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    embeddings = {
        id(module.weight)
        for module in model.modules()
        if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead)
    }
    return [
        module
        for module in model.modules()
        if isinstance(module, ParallelLMHead) and id(module.weight) in embeddings
    ]


def refresh_tied_heads(heads: Sequence[torch.nn.Module]) -> None:
    """Rerun each head's post-load processing on the weight it now shares."""
    for head in heads:
        method = getattr(head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(head)
