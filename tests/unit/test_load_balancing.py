"""The per-sequence load-balancing loss: one sequence alone is megatron's Switch loss over its
tokens (as megatron attaches it per token, times the token count); several are the sum of
each alone, whatever pass or layout holds them; padding takes no part."""

from __future__ import annotations

import numpy as np
import torch
from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

from tests.support.batches import make_batch
from trainer_svc.domain import LossConfig
from trainer_svc.runtime.load_balancing import per_sequence_loss, sequence_ids
from trainer_svc.runtime.packing import pack

EXPERTS, TOP_K, COEFF = 8, 2, 0.1


def _routed(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, EXPERTS, generator=torch.Generator().manual_seed(seed))
    chosen = logits.topk(TOP_K, dim=-1).indices
    routing_map = torch.zeros(tokens, EXPERTS, dtype=torch.bool).scatter_(1, chosen, True)
    return logits, routing_map


def test_one_sequence_is_megatrons_switch_loss_times_its_tokens():
    logits, routing_map = _routed(13, seed=1)
    ids = torch.zeros(13, dtype=torch.int64)
    ours = per_sequence_loss(logits, routing_map, ids, TOP_K, COEFF, sequences=1)
    theirs = switch_load_balancing_loss_func(
        probs=torch.softmax(logits, dim=-1),
        tokens_per_expert=routing_map.sum(0).float(),
        total_num_tokens=13,
        topk=TOP_K,
        num_experts=EXPERTS,
        moe_aux_loss_coeff=COEFF,
    )
    torch.testing.assert_close(ours, theirs * 13)


def test_sequences_add_up_and_padding_is_ignored():
    logits, routing_map = _routed(20, seed=2)
    ids = torch.tensor([0] * 7 + [-1] * 3 + [1] * 10)
    together = per_sequence_loss(logits, routing_map, ids, TOP_K, COEFF, sequences=2)
    alone = [
        per_sequence_loss(
            logits[ids == s], routing_map[ids == s], ids[ids == s] * 0, TOP_K, COEFF, sequences=1
        )
        for s in (0, 1)
    ]
    torch.testing.assert_close(together, alone[0] + alone[1])


def test_sequence_ids_follow_the_routers_token_order_in_both_layouts():
    """megatron's hidden states are [width, rows]: position p of row r is token p * rows + r."""
    batch = make_batch(seed=3, lengths=[4, 1, 3], loss=LossConfig())
    padded = pack(batch, torch.device("cpu"), packed=False)
    packed = pack(batch, torch.device("cpu"), packed=True)
    assert padded is not None and packed is not None
    rows = np.array([[0, 0, 0], [-1, -1, -1], [2, 2, -1]])  # inputs: 3, 0 and 2 positions
    assert sequence_ids(padded).tolist() == rows.T.reshape(-1).tolist()
    assert sequence_ids(packed).tolist() == [0, 0, 0, 2, 2]
