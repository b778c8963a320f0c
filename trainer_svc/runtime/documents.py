"""Several sequences (documents) in one row: where each one starts, and the positions RoPE
gives its tokens.

A packed row is one sequence dimension of T tokens, batch 1, in megatron's usual [s, b, ...]
layout (`qkv_format="sbhd"`), not its THD format. THD's unfused RoPE splits the row with a
host round trip per attention layer (`cu_seqlens.tolist()`), which would stall a GPU step on
every layer. Here RoPE stays megatron's bshd path, fed with the angles of each token's own
position: a forward hook on every rotary module gathers the rows of its usual [max_len, 1, 1,
dim] table at the row's positions. Position p of a sequence thus gets exactly the angles it
gets unpacked. The core attention (`SdpaAttention`) reads the document bounds from the same
`DocumentBounds` and keeps each token's attention inside its own sequence, with the kernel
`--packed-attention` chose (`resolve`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from trainer_svc.config import PackedAttention, SequenceLayout
from trainer_svc.runtime import ragged_attention
from trainer_svc.runtime.sdpa_attention import SdpaAttention

_HOOKED = "_trainer_document_positions"
"""Marks a module whose rotary table is already gathered (installing twice would gather twice)."""


@dataclass
class DocumentBounds(PackedSeqParams):
    """megatron's packed-sequence parameters plus what the unfused paths need without a
    host round trip: each token's position in its sequence (on the device) and the sequence
    lengths (on the host)."""

    positions: torch.Tensor | None = None
    lengths: tuple[int, ...] = ()


def bounds(lengths: list[int], positions: torch.Tensor, cu_seqlens: torch.Tensor) -> DocumentBounds:
    """`lengths`: tokens per sequence in the row; `cu_seqlens`: their int32 prefix sums with a
    leading 0, already on the row's device."""
    longest = max(lengths)
    return DocumentBounds(
        qkv_format="sbhd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        positions=positions,
        lengths=tuple(lengths),
    )


PADDING_WORTH_PACKING = 1.15
"""AUTO packs a pass whose padded rows would compute more than this many times its tokens.

Below it the padded rows win on a GPU: their attention runs cuDNN's dense kernel, which does a
token's attention work faster than either variable-length kernel a packed row can use (cuDNN's
ragged one or flash), so packing pays only where the padding it saves outweighs that (the
measurements behind the threshold: BENCHMARKS.md, "Known gaps"; it was set against flash).
Equal lengths (no padding) stay padded."""


def resolve(
    layout: SequenceLayout,
    model: torch.nn.Module,
    attention: PackedAttention = PackedAttention.AUTO,
) -> SequenceLayout:
    """The layout this model runs: PACKED where asked (refused, with the reason, where a core
    attention cannot keep documents apart), AUTO (each pass packed where that pays, `packs`)
    where every core attention is `SdpaAttention`, else PADDED. Installs the position hooks
    where it may pack, and gives every core attention the packed-row kernel `attention` (on
    a GPU, CUDNN is refused where cuDNN's ragged attention cannot run)."""
    cores = [m.core_attention for m in model.modules() if hasattr(m, "core_attention")]
    capable = bool(cores) and all(isinstance(core, SdpaAttention) for core in cores)
    if layout is SequenceLayout.PADDED:
        return SequenceLayout.PADDED
    if not capable:
        if layout is SequenceLayout.PACKED:
            kinds = sorted({type(core).__name__ for core in cores}) or ["none"]
            raise ValueError(
                f"--sequence-layout packed needs the SDPA core attention (--attention sdpa); "
                f"this model's is {', '.join(kinds)}"
            )
        return SequenceLayout.PADDED
    if attention is PackedAttention.CUDNN:
        weight = next(model.parameters())
        if weight.is_cuda:
            reason = ragged_attention.unavailable(weight.device, weight.dtype)
            if reason is not None:
                raise ValueError(f"--packed-attention cudnn cannot run here: {reason}")
    for core in cores:
        assert isinstance(core, SdpaAttention)
        core.packed_attention = attention
    install_position_hooks(model)
    return layout


def packs(layout: SequenceLayout, lengths: np.ndarray) -> bool:
    """Whether a pass of sequences of these lengths goes in as one packed row."""
    if layout is not SequenceLayout.AUTO:
        return layout is SequenceLayout.PACKED
    predicted = np.asarray(lengths, dtype=np.int64) - 1
    tokens = int(predicted.sum())
    padded = len(predicted) * int(predicted.max()) if len(predicted) else 0
    return padded > PADDING_WORTH_PACKING * tokens


def install_position_hooks(model: torch.nn.Module) -> None:
    """For every module owning a `rotary_pos_emb` (each pipeline chunk's GPT model): while it
    runs with `DocumentBounds`, its rotary table is gathered at the row's positions."""
    for owner in model.modules():
        rotary = getattr(owner, "rotary_pos_emb", None)
        if not isinstance(rotary, torch.nn.Module) or getattr(owner, _HOOKED, False):
            continue
        setattr(owner, _HOOKED, True)
        current: list[DocumentBounds | None] = [None]

        def remember(
            module: torch.nn.Module,
            args: tuple[Any, ...],
            kwargs: dict[str, Any],
            current: list[DocumentBounds | None] = current,
        ) -> None:
            given = kwargs.get("packed_seq_params")
            current[0] = given if isinstance(given, DocumentBounds) else None

        def forget(
            module: torch.nn.Module,
            args: tuple[Any, ...],
            kwargs: dict[str, Any],
            output: Any,
            current: list[DocumentBounds | None] = current,
        ) -> None:
            current[0] = None

        def gather(
            module: torch.nn.Module,
            args: tuple[Any, ...],
            output: torch.Tensor,
            current: list[DocumentBounds | None] = current,
        ) -> torch.Tensor:
            documents = current[0]
            if documents is None or documents.positions is None:
                return output
            return output[documents.positions]

        owner.register_forward_pre_hook(remember, with_kwargs=True)
        owner.register_forward_hook(forget, with_kwargs=True, always_call=True)
        rotary.register_forward_hook(gather)
