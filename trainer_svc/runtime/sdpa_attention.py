"""Core attention through PyTorch's fused scaled-dot-product attention, for ranks without
Transformer Engine (issue: the local spec's attention is two batched matmuls around an fp32
softmax over a materialised [b, heads, s, s] score tensor).

`SdpaAttention` is megatron's local `DotProductAttention` (same constructor, same parameters and
state dict, the same [s, b, heads, dim] -> [s, b, hidden] contract) whose forward calls
`torch.nn.functional.scaled_dot_product_attention`: on a GPU its flash or memory-efficient
kernel (softmax in fp32 inside the kernel, no score tensor in memory), on the CPU torch's own
fused kernel. Grouped-query attention goes in as is (``enable_gqa``), without repeating keys
and values. What the fused call does not cover (an explicit mask, an attention bias, a softmax
offset, sliding windows, query-key layer scaling) falls back to the local path, so the module
is never less capable than the one it replaces.

A packed row (`runtime/documents.py`: several sequences in one row, `DocumentBounds`) is
attended document by document, causal inside each: on a GPU in half precision through
cuDNN's ragged-layout attention (`runtime/ragged_attention.py`, Hopper or newer) or PyTorch's
variable-length flash attention (`torch.nn.attention.varlen`), one kernel for the row, as
`packed_attention` says; elsewhere (the CPU, float32) as one fused call per sequence, which
computes exactly what the sequence's own padded row computes.

`tests/trainer/test_sdpa_attention.py` holds it to the local attention's output and gradients.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from trainer_svc.config import PackedAttention
from trainer_svc.runtime import ragged_attention


class SdpaAttention(DotProductAttention):
    packed_attention: PackedAttention = PackedAttention.AUTO
    """The kernel of a packed row on a GPU in half precision (`documents.resolve` sets it)."""

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
        lengths = getattr(packed_seq_params, "lengths", None)
        if (
            lengths
            and mask_type is AttnMaskType.causal
            and self._fused_applies(attention_mask, attention_bias, mask_type)
        ):
            return self._documents(query, key, value, packed_seq_params)
        if (
            not self._fused_applies(attention_mask, attention_bias, mask_type)
            or packed_seq_params is not None
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

    def _fused_applies(
        self,
        attention_mask: torch.Tensor | None,
        attention_bias: torch.Tensor | None,
        mask_type: AttnMaskType,
    ) -> bool:
        return (
            attention_mask is None
            and attention_bias is None
            and self.softmax_offset is None
            and self.scale_mask_softmax.window_size is None
            and not self.config.apply_query_key_layer_scaling
            and mask_type in (AttnMaskType.causal, AttnMaskType.no_mask)
        )

    def _documents(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, documents: Any
    ) -> torch.Tensor:
        """Causal attention inside each sequence of a packed [T, 1, heads, dim] row."""
        total = query.shape[0]
        assert query.shape[1] == 1, "a packed row has batch size 1"
        grouped = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        dropout = self.attention_dropout.p if self.training else 0.0
        q, k, v = (x[:, 0] for x in (query, key, value))  # [T, heads, dim]
        if self.packed_attention is not PackedAttention.FLASH and ragged_attention.applies(
            q, dropout
        ):
            ragged = ragged_attention.attention(
                q,
                k,
                v,
                cu_seqlens=documents.cu_seqlens_q,
                longest=documents.max_seqlen_q,
                scale=float(self.softmax_scale),
            )
            if ragged is not None:  # else cuDNN cannot build this row's graphs: flash runs it
                return ragged.reshape(total, 1, self.hidden_size_per_partition)
        varlen = _varlen_call(q, self.softmax_scale, grouped, dropout)
        if varlen is not None:
            context = varlen(
                q,
                k,
                v,
                documents.cu_seqlens_q,
                documents.cu_seqlens_kv,
                documents.max_seqlen_q,
                documents.max_seqlen_kv,
            )
        else:
            pieces = []
            start = 0
            for length in documents.lengths:
                # [len, heads, dim] -> [1, heads, len, dim]
                qs, ks, vs = (x[start : start + length].transpose(0, 1)[None] for x in (q, k, v))
                out = F.scaled_dot_product_attention(
                    qs,
                    ks,
                    vs,
                    dropout_p=dropout,
                    is_causal=True,
                    scale=self.softmax_scale,
                    enable_gqa=grouped,
                )
                pieces.append(out[0].transpose(0, 1))
                start += length
            context = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        return context.reshape(total, 1, self.hidden_size_per_partition)


@cache
def _varlen_parameters() -> frozenset[str]:
    """The keyword arguments this PyTorch's `varlen_attn` takes (none where it has none)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return frozenset()
    return frozenset(inspect.signature(varlen_attn).parameters)


def _varlen_call(query: torch.Tensor, scale: float | None, grouped: bool, dropout: float) -> Any:
    """PyTorch's variable-length flash attention bound to causal masking and `scale`, or None
    where it does not apply: not on CUDA, not half precision, dropout, or a PyTorch whose
    `varlen_attn` cannot take the scale or the causal mask asked for."""
    names = _varlen_parameters()
    if (
        not names
        or not query.is_cuda
        or query.dtype not in (torch.float16, torch.bfloat16)
        or dropout
    ):
        return None
    from torch.nn.attention.varlen import varlen_attn

    options: dict[str, Any] = {}
    if "window_size" in names:
        options["window_size"] = (-1, 0)  # causal
    elif "is_causal" in names:
        options["is_causal"] = True
    else:
        return None
    if scale is not None:
        if "scale" not in names:
            return None
        options["scale"] = scale
    if grouped and "enable_gqa" in names:
        options["enable_gqa"] = True

    def call(*args: Any) -> torch.Tensor:
        out = varlen_attn(*args, **options)
        assert isinstance(out, torch.Tensor)  # no auxiliary outputs asked for
        return out

    return call
