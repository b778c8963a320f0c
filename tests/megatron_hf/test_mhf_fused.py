"""Fused QKV and gate/up orderings against explicit hand construction and Megatron's split."""

from __future__ import annotations

import pytest
import torch

from megatron_hf.fused import fuse_gate_up, fuse_qkv, split_gate_up, split_qkv

HEADS, GROUPS, HEAD_DIM, HIDDEN = 6, 2, 4, 5
PER_GROUP = HEADS // GROUPS


def _tagged(rows: int, base: float, cols: int | None = HIDDEN) -> torch.Tensor:
    """Row i holds base + i everywhere, so every row is identifiable after reordering."""
    tags = base + torch.arange(rows, dtype=torch.float64)
    return tags if cols is None else tags[:, None].expand(rows, cols).clone()


@pytest.mark.parametrize("cols", [HIDDEN, None], ids=["weight", "bias"])
def test_fuse_qkv_rows_are_grouped_per_query_group(cols: int | None) -> None:
    q = _tagged(HEADS * HEAD_DIM, 0.0, cols)
    k = _tagged(GROUPS * HEAD_DIM, 1000.0, cols)
    v = _tagged(GROUPS * HEAD_DIM, 2000.0, cols)
    fused = fuse_qkv(q, k, v, num_attention_heads=HEADS, num_query_groups=GROUPS, head_dim=HEAD_DIM)

    block = (PER_GROUP + 2) * HEAD_DIM
    assert fused.shape[0] == GROUPS * block
    expected_rows = []
    for g in range(GROUPS):
        # group g: query heads g*PER_GROUP .. (g+1)*PER_GROUP-1, then key head g, value head g
        for head in range(g * PER_GROUP, (g + 1) * PER_GROUP):
            expected_rows += [q[head * HEAD_DIM + j] for j in range(HEAD_DIM)]
        expected_rows += [k[g * HEAD_DIM + j] for j in range(HEAD_DIM)]
        expected_rows += [v[g * HEAD_DIM + j] for j in range(HEAD_DIM)]
    assert torch.equal(fused, torch.stack(expected_rows))
    # spot-check the documented offsets: q rows of group g start at g*(q_per_group+2)*head_dim
    assert torch.equal(fused[1 * block], q[PER_GROUP * HEAD_DIM])
    assert torch.equal(fused[1 * block + PER_GROUP * HEAD_DIM], k[HEAD_DIM])
    assert torch.equal(fused[1 * block + (PER_GROUP + 1) * HEAD_DIM], v[HEAD_DIM])

    q2, k2, v2 = split_qkv(
        fused, num_attention_heads=HEADS, num_query_groups=GROUPS, head_dim=HEAD_DIM
    )
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_fused_layout_matches_megatron_self_attention_split() -> None:
    """Megatron's SelfAttention.get_query_key_value_tensors, restated, yields HF's q, k, v."""
    torch.manual_seed(0)
    wq = torch.randn(HEADS * HEAD_DIM, HIDDEN)
    wk, wv = torch.randn(2, GROUPS * HEAD_DIM, HIDDEN)
    bq, bk, bv = torch.randn(HEADS * HEAD_DIM), *torch.randn(2, GROUPS * HEAD_DIM)
    kwargs = {"num_attention_heads": HEADS, "num_query_groups": GROUPS, "head_dim": HEAD_DIM}
    w_qkv = fuse_qkv(wq, wk, wv, **kwargs)
    b_qkv = fuse_qkv(bq, bk, bv, **kwargs)
    x = torch.randn(3, 2, HIDDEN)  # [sq, b, h]

    mixed = x @ w_qkv.T + b_qkv  # [sq, b, ng * (np/ng + 2) * hn]
    mixed = mixed.view(3, 2, GROUPS, (PER_GROUP + 2) * HEAD_DIM)
    query, key, value = torch.split(mixed, [PER_GROUP * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=3)
    query = query.reshape(3, 2, -1, HEAD_DIM)  # [sq, b, np, hn]

    torch.testing.assert_close(query, (x @ wq.T + bq).view(3, 2, HEADS, HEAD_DIM))
    torch.testing.assert_close(key, (x @ wk.T + bk).view(3, 2, GROUPS, HEAD_DIM))
    torch.testing.assert_close(value, (x @ wv.T + bv).view(3, 2, GROUPS, HEAD_DIM))


def test_mqa_single_group() -> None:
    q, k, v = _tagged(8, 0.0), _tagged(2, 100.0), _tagged(2, 200.0)
    fused = fuse_qkv(q, k, v, num_attention_heads=4, num_query_groups=1, head_dim=2)
    assert torch.equal(fused, torch.cat([q, k, v]))


def test_qkv_shape_errors_are_explained() -> None:
    q, k, v = _tagged(HEADS * HEAD_DIM, 0.0), _tagged(GROUPS * HEAD_DIM, 0.0), _tagged(3, 0.0)
    with pytest.raises(ValueError, match=r"v has shape \(3, 5\), expected \(8, 5\)"):
        fuse_qkv(q, k, v, num_attention_heads=HEADS, num_query_groups=GROUPS, head_dim=HEAD_DIM)
    with pytest.raises(ValueError, match="must be a positive multiple"):
        split_qkv(q, num_attention_heads=HEADS, num_query_groups=4, head_dim=HEAD_DIM)
    with pytest.raises(ValueError, match="expected 40 rows"):
        split_qkv(q, num_attention_heads=HEADS, num_query_groups=GROUPS, head_dim=HEAD_DIM)


def test_gate_up_is_gate_then_up() -> None:
    gate, up = _tagged(6, 0.0), _tagged(6, 100.0)
    fc1 = fuse_gate_up(gate, up)
    assert torch.equal(fc1[:6], gate) and torch.equal(fc1[6:], up)
    gate2, up2 = split_gate_up(fc1)
    assert torch.equal(gate2, gate) and torch.equal(up2, up)
    # Megatron's glu: x_glu, x_linear = chunk(x, 2, dim=-1); act(x_glu) * x_linear
    x = torch.randn(3, HIDDEN, dtype=torch.float64)
    x_glu, x_linear = torch.chunk(x @ fc1.T, 2, dim=-1)
    torch.testing.assert_close(x_glu, x @ gate.T)
    torch.testing.assert_close(x_linear, x @ up.T)


def test_gate_up_errors() -> None:
    with pytest.raises(ValueError, match="shapes differ"):
        fuse_gate_up(_tagged(6, 0.0), _tagged(5, 0.0))
    with pytest.raises(ValueError, match="no even"):
        split_gate_up(_tagged(5, 0.0))
