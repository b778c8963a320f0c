"""Core attention through PyTorch's fused scaled-dot-product attention, for ranks without
Transformer Engine (issue: the local spec's attention is two batched matmuls around an fp32
softmax over a materialised [b, heads, s, s] score tensor).

`SdpaAttention` is megatron's local `DotProductAttention` (same constructor, same parameters and
state dict, the same [s, b, heads, dim] -> [s, b, hidden] contract) whose forward calls
`torch.nn.functional.scaled_dot_product_attention`: on a GPU its flash or memory-efficient
kernel (softmax in fp32 inside the kernel, no score tensor in memory), on the CPU torch's own
fused kernel. Grouped-query attention goes in as is (``enable_gqa``), without repeating keys
and values. What the fused call does not cover (an explicit mask, an attention bias, packed
sequences, a softmax offset, sliding windows, query-key layer scaling) falls back to the local
path, so the module is never less capable than the one it replaces.

`tests/trainer/test_sdpa_attention.py` holds it to the local attention's output and gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SdpaAttention(DotProductAttention):
    def forward(  # noqa: PLR0917 (megatron calls it positionally)
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if (
            attention_mask is not None
            or attention_bias is not None
            or packed_seq_params is not None
            or self.softmax_offset is not None
            or self.scale_mask_softmax.window_size is not None
            or self.config.apply_query_key_layer_scaling
            or mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask)
        ):
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )
        seq, batch = query.shape[0], query.shape[1]
        # [s, b, heads, dim] -> [b, heads, s, dim]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        grouped = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        dropout = self.attention_dropout.p if self.training else 0.0
        context = F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=dropout,
            is_causal=mask_type is AttnMaskType.causal,
            scale=self.softmax_scale,
            enable_gqa=grouped,
        )
        # [b, heads, s, dim] -> [s, b, heads * dim]
        return context.permute(2, 0, 1, 3).reshape(seq, batch, self.hidden_size_per_partition)
