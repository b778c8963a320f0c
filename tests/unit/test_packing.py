"""assign_to_data_parallel, pack (padded and packed layouts) and per_token on hand-checked and
random batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer_svc.domain import SequenceBatch
from trainer_svc.runtime.packing import assign_to_data_parallel, pack

CPU = torch.device("cpu")


def test_assign_hand_checked_example() -> None:
    # Longest first to the least loaded rank (lowest rank on ties):
    # 5 -> r0 (5,0); 4 -> r1 (5,4); 3 -> r1 (5,7); 2 -> r0 (7,7); 1 -> r0 (8,7).
    parts = assign_to_data_parallel(np.array([5, 1, 4, 2, 3]), 2)
    assert [p.tolist() for p in parts] == [[0, 1, 3], [2, 4]]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dp_size", [1, 2, 3, 8])
def test_assign_partitions_balances_and_keeps_order(seed: int, dp_size: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 64, size=int(rng.integers(1, 30)))
    parts = assign_to_data_parallel(lengths, dp_size)
    assert len(parts) == dp_size
    # Every sequence exactly once.
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(lengths)))
    # Request order within each rank.
    for part in parts:
        assert part.tolist() == sorted(part.tolist())
    # Greedy longest-first: no rank carries more than one sequence beyond the lightest one.
    loads = [int(lengths[p].sum()) for p in parts]
    assert max(loads) - min(loads) <= int(lengths.max())
    # Deterministic: every rank computes the same split.
    again = assign_to_data_parallel(lengths.copy(), dp_size)
    assert [p.tolist() for p in again] == [p.tolist() for p in parts]


def test_assign_more_ranks_than_sequences_leaves_ranks_empty() -> None:
    parts = assign_to_data_parallel(np.array([3, 7]), 4)
    assert [p.tolist() for p in parts] == [[1], [0], [], []]


def test_assign_is_balanced_for_equal_lengths() -> None:
    parts = assign_to_data_parallel(np.full(12, 5), 4)
    assert [len(p) for p in parts] == [3, 3, 3, 3]


def hand_batch() -> SequenceBatch:
    return SequenceBatch.from_lists(
        [[1, 2, 3, 4], [5, 6], [7]],
        loss_mask=[[False, True, False, True], [False, True], [False]],
        advantages=[[10, 11, 12, 13], [20, 21], [30]],
        behaviour_logprobs=[[-1, -2, -3, -4], [-5, -6], [-7]],
    )


def test_pack_hand_checked_layout() -> None:
    packed = pack(hand_batch(), CPU)
    assert packed is not None
    assert (packed.rows, packed.width) == (3, 3)
    assert packed.inputs.tolist() == [[1, 2, 3], [5, 0, 0], [0, 0, 0]]
    assert packed.targets.tolist() == [[2, 3, 4], [6, 0, 0], [0, 0, 0]]
    assert packed.positions.tolist() == [[0, 1, 2]] * 3
    assert packed.target_counts.tolist() == [3, 1, 0]
    inputs = packed.token_inputs
    # Token j's entry lands at position j-1 of its row; padding is false / zero.
    assert inputs.mask.tolist() == [[True, False, True], [True, False, False], [False] * 3]
    assert inputs.advantages.tolist() == [[11, 12, 13], [21, 0, 0], [0, 0, 0]]
    assert inputs.behaviour_logprobs.tolist() == [[-2, -3, -4], [-6, 0, 0], [0, 0, 0]]
    assert inputs.reference_logprobs is None
    assert inputs.mask.dtype == torch.bool
    assert inputs.advantages.dtype == torch.float32
    assert packed.inputs.dtype == torch.int64
    assert packed.targets.dtype == torch.int64


def test_pack_shifts_inputs_and_targets_by_one() -> None:
    rng = np.random.default_rng(0)
    lengths = [5, 2, 9, 1, 4]
    batch = SequenceBatch.from_lists([rng.integers(0, 100, n).tolist() for n in lengths])
    packed = pack(batch, CPU)
    assert packed is not None
    assert packed.width == max(lengths) - 1
    for row, tokens in enumerate(batch.per_sequence(batch.tokens)):
        n = len(tokens) - 1
        assert packed.inputs[row, :n].tolist() == tokens[:-1].tolist()
        assert packed.targets[row, :n].tolist() == tokens[1:].tolist()
        assert not packed.inputs[row, n:].any()
        assert not packed.targets[row, n:].any()


def test_pack_without_a_mask_masks_everything_out() -> None:
    packed = pack(SequenceBatch.from_lists([[1, 2, 3], [4, 5]]), CPU)
    assert packed is not None
    assert packed.token_inputs.mask.dtype == torch.bool
    assert not packed.token_inputs.mask.any()
    assert packed.token_inputs.advantages is None


@pytest.mark.parametrize("sequences", [[[1]], [[1], [2], [3]]])
def test_pack_returns_none_without_a_position_to_predict(sequences: list[list[int]]) -> None:
    assert pack(SequenceBatch.from_lists(sequences), CPU) is None


def test_pack_of_an_empty_selection_is_none() -> None:
    assert pack(hand_batch().select(np.array([], dtype=np.int64)), CPU) is None


@pytest.mark.parametrize("one_row", [False, True], ids=["padded", "packed"])
def test_per_token_inverts_the_position_layout(one_row: bool) -> None:
    rng = np.random.default_rng(1)
    lengths = [4, 1, 6, 2]
    values = [rng.normal(size=n).astype(np.float32) for n in lengths]
    batch = SequenceBatch.from_lists(
        [rng.integers(0, 9, n).tolist() for n in lengths], advantages=values
    )
    packed = pack(batch, CPU, packed=one_row)
    assert packed is not None
    flat = packed.per_token(packed.token_inputs.advantages.numpy(), batch)
    expected = batch.advantages.copy()
    expected[batch.offsets[:-1]] = 0.0  # first tokens have no prediction
    assert flat.dtype == np.float32
    assert np.array_equal(flat, expected)


def test_per_token_keeps_trailing_dimensions() -> None:
    # Top-k rows are [rows, width, k]; token j gets position j-1's k entries.
    batch = SequenceBatch.from_lists([[1, 2, 3], [4, 5]])
    packed = pack(batch, CPU)
    assert packed is not None
    rows = np.arange(2 * 2 * 3, dtype=np.int32).reshape(2, 2, 3)
    flat = packed.per_token(rows, batch)
    assert flat.shape == (5, 3)
    assert flat.dtype == np.int32
    assert flat.tolist() == [
        [0, 0, 0],
        [0, 1, 2],
        [3, 4, 5],
        [0, 0, 0],
        [6, 7, 8],
    ]


def test_pack_one_row_hand_checked_layout() -> None:
    packed = pack(hand_batch(), CPU, packed=True)
    assert packed is not None
    # Sequences [1 2 3 4], [5 6], [7]: 3 + 1 + 0 predicted positions, back to back.
    assert (packed.rows, packed.width) == (1, 4)
    assert packed.inputs.tolist() == [[1, 2, 3, 5]]
    assert packed.targets.tolist() == [[2, 3, 4, 6]]
    # Positions restart for each sequence; the one-token sequence has no place in the row.
    assert packed.positions.tolist() == [[0, 1, 2, 0]]
    documents = packed.documents
    assert documents is not None
    assert documents.lengths == (3, 1)
    assert documents.cu_seqlens_q.tolist() == [0, 3, 4]
    assert documents.cu_seqlens_q.dtype == torch.int32
    assert documents.max_seqlen_q == documents.max_seqlen_kv == 3
    assert documents.positions.tolist() == [0, 1, 2, 0]
    inputs = packed.token_inputs
    assert inputs.mask.tolist() == [[True, False, True, True]]
    assert inputs.advantages.tolist() == [[11, 12, 13, 21]]
    assert inputs.behaviour_logprobs.tolist() == [[-2, -3, -4, -6]]
    # Each position carries its sequence's count of trained targets (2 and 1).
    assert inputs.sequence_tokens.tolist() == [[2, 2, 2, 1]]


def test_padded_rows_carry_their_sequences_trained_counts() -> None:
    packed = pack(hand_batch(), CPU)
    assert packed is not None
    assert packed.documents is None
    # Padding positions hold 0 (their mask is false).
    assert packed.token_inputs.sequence_tokens.tolist() == [[2, 2, 2], [1, 0, 0], [0, 0, 0]]


@pytest.mark.parametrize("seed", range(4))
def test_both_layouts_hold_the_same_positions_and_values(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 12, size=int(rng.integers(1, 9))).tolist()
    batch = SequenceBatch.from_lists(
        [rng.integers(0, 50, n).tolist() for n in lengths],
        loss_mask=[rng.random(n) < 0.7 for n in lengths],
        advantages=[rng.normal(size=n) for n in lengths],
    )
    padded, packed = pack(batch, CPU), pack(batch, CPU, packed=True)
    if padded is None:
        assert packed is None
        return
    assert packed is not None
    valid = padded.positions < torch.as_tensor(padded.target_counts)[:, None]
    for name in ("inputs", "targets", "positions"):
        assert torch.equal(getattr(padded, name)[valid], getattr(packed, name)[0])
    for name in ("mask", "advantages", "sequence_tokens"):
        got = getattr(packed.token_inputs, name)[0]
        assert torch.equal(getattr(padded.token_inputs, name)[valid], got)


@pytest.mark.parametrize("packed", [False, True])
def test_a_sequence_parallel_pass_is_padded_to_its_ranks_and_each_routes_its_part(
    packed: bool,
) -> None:
    """Sequence-parallel TP ranks split the positions evenly: the width is padded to a multiple
    of them (a packed row's tail becomes a padding document of its own), and each rank's
    routers see its part of the `[width, rows]` order; the parts together are the whole."""
    batch = SequenceBatch.from_lists([[1, 2, 3, 4], [5, 6, 7]], loss_mask=[[True] * 4, [True] * 3])
    whole = pack(batch, torch.device("cpu"), packed=packed)
    assert whole is not None
    parts = [pack(batch, torch.device("cpu"), packed=packed, shard=(r, 2)) for r in range(2)]
    assert all(p is not None for p in parts)
    first, second = parts
    assert first is not None and second is not None
    width = 6 if packed else 4  # 3 + 2 positions in one row, or rows of 3, padded to 4
    assert first.width == second.width == width
    if packed:
        assert first.documents is not None
        assert first.documents.lengths == (3, 2, 1)  # the padding's document last
        assert first.positions.tolist() == [[0, 1, 2, 0, 1, 0]]
    assert not first.token_inputs.mask[:, whole.width :].any()
    orders = [p.router_order() for p in (first, second)]
    joined = [np.concatenate([o[k] for o in orders]) for k in range(2)]
    unsplit = pack(batch, torch.device("cpu"), packed=packed, shard=(0, 1))
    assert unsplit is not None and unsplit.width == whole.width
    real = joined[0] >= 0
    assert sorted(zip(joined[0][real], joined[1][real], strict=True)) == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 1),
    ]
    assert all(len(o[0]) == width // 2 * first.rows for o in orders)
