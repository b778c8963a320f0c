"""Fused Megatron tensors and their HF parts, with the row ordering stated.

These work on global tensors and equally on one TP shard (pass per-partition head/group counts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from megatron_hf.experts import HFExpertNames


def fuse_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_attention_heads: int,
    num_query_groups: int,
    head_dim: int,
) -> torch.Tensor:
    """HF q/k/v -> Megatron linear_qkv, rows grouped per query group.

    For group g = 0..groups-1 the fused tensor holds, in order, the heads/groups query heads
    g*heads/groups .. (g+1)*heads/groups - 1, then key head g, then value head g, each head_dim
    rows. Works for weights [rows, hidden] and biases [rows].
    """
    groups, per_group = _group_shape(num_attention_heads, num_query_groups)
    rest = tuple(q.shape[1:])
    expected = {
        "q": (num_attention_heads * head_dim, *rest),
        "k": (groups * head_dim, *rest),
        "v": (groups * head_dim, *rest),
    }
    for label, tensor in (("q", q), ("k", k), ("v", v)):
        if tuple(tensor.shape) != expected[label]:
            raise ValueError(
                f"{label} has shape {tuple(tensor.shape)}, expected {expected[label]} for "
                f"{num_attention_heads} heads, {groups} groups, head_dim {head_dim}"
            )
    fused = torch.cat(
        [
            q.reshape(groups, per_group * head_dim, *rest),
            k.reshape(groups, head_dim, *rest),
            v.reshape(groups, head_dim, *rest),
        ],
        dim=1,
    )
    return fused.reshape(groups * (per_group + 2) * head_dim, *rest)


def split_qkv(
    qkv: torch.Tensor, *, num_attention_heads: int, num_query_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of fuse_qkv: Megatron linear_qkv (weight or bias) -> HF (q, k, v)."""
    groups, per_group = _group_shape(num_attention_heads, num_query_groups)
    rows = groups * (per_group + 2) * head_dim
    if qkv.dim() == 0 or qkv.shape[0] != rows:
        raise ValueError(
            f"linear_qkv has shape {tuple(qkv.shape)}, expected {rows} rows for "
            f"{num_attention_heads} heads, {groups} groups, head_dim {head_dim}"
        )
    rest = tuple(qkv.shape[1:])
    grouped = qkv.reshape(groups, (per_group + 2) * head_dim, *rest)
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF gate_proj, up_proj -> Megatron linear_fc1 = [gate; up] along dim 0."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} shapes differ")
    return torch.cat([gate, up], dim=0)


def stack_experts(
    weight: Callable[[int, str], torch.Tensor],
    names: HFExpertNames,
    experts: Iterable[int],
    columns: slice = slice(None),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's per-expert HF weights (`weight(expert, projection)`) as fused 3-D tensors,
    as vLLM and transformers hold them: [E, 2I, H] of each expert's [gate; up] rows and
    [E, H, I] of its down; `columns` keeps a share of the width I (a TP worker's)."""
    chosen = list(experts)
    gate_up = [
        fuse_gate_up(weight(e, names.gate)[columns], weight(e, names.up)[columns]) for e in chosen
    ]
    down = [weight(e, names.down)[:, columns] for e in chosen]
    return torch.stack(gate_up), torch.stack(down)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron linear_fc1 (global, or one TP shard) -> (gate, up): first half, second half."""
    if fc1.dim() == 0 or fc1.shape[0] % 2:
        raise ValueError(f"linear_fc1 of shape {tuple(fc1.shape)} has no even [gate; up] split")
    gate, up = fc1.chunk(2, dim=0)
    return gate, up


def _group_shape(num_attention_heads: int, num_query_groups: int) -> tuple[int, int]:
    if num_query_groups <= 0 or num_attention_heads % num_query_groups:
        raise ValueError(
            f"num_attention_heads ({num_attention_heads}) must be a positive multiple of "
            f"num_query_groups ({num_query_groups})"
        )
    return num_query_groups, num_attention_heads // num_query_groups
