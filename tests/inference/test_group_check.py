"""The workers' agreement with their partial sums (inference_ext/group_check.py) in a real
two-rank gloo world: halves of a TP=1 trainer's shards that add up pass with counts on both
ranks; one flipped byte in one rank's half fails both with the same words; a rank that has no
bytes makes both not ready, and a rank that read nothing in parts still takes part; the ranks
stay in step for the next collective after each."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from inference_ext.group_check import Agreement, agree
from refit_sidecar.integrity.partial_sums import PartialSums
from tests.support.gloo_ranks import rank_reports
from tests.support.partial_reads import no_partial_reads, pull_half, source_slot

WORLD = 2


def _scenarios() -> dict[str, list[tuple[bool, PartialSums | None]]]:
    """Per scenario, each rank's (has its bytes, partial sums)."""
    manifest, buffers = source_slot()
    halves = [pull_half(manifest, buffers, w)[3].partial_sums for w in range(WORLD)]
    buffers["row_parallel"][10 * 192 + 150] ^= 0x40  # in worker 1's column half
    broken = pull_half(manifest, buffers, 1)[3].partial_sums
    assert all(h is not None for h in halves) and broken is not None
    empty = no_partial_reads(halves[0].order)
    return {
        "halves": [(True, halves[0]), (True, halves[1])],
        "one byte flipped": [(True, halves[0]), (True, broken)],
        "rank 1 has no bytes": [(True, halves[0]), (False, None)],
        "rank 0 read nothing in parts": [(True, empty), (True, halves[1])],
        "not verifying": [(True, None), (True, None)],
    }


def _rank_main(rank: int, store: str, scenarios: dict, report: Any) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
        outcomes: dict[str, Any] = {}
        for name, per_rank in scenarios.items():
            ready, partial = per_rank[rank]
            outcomes[name] = agree(ready, partial, dist.group.WORLD)
            total = torch.tensor([rank + 1])
            dist.all_reduce(total)  # still in step
            outcomes[f"{name}: in step"] = int(total.item())
        dist.destroy_process_group()
        report.send(outcomes)
    except BaseException:
        report.send(traceback.format_exc())


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    store = str(Path(tmp_path_factory.mktemp("group-check")) / "rendezvous")
    scenarios = _scenarios()
    return rank_reports(_rank_main, WORLD, store, scenarios)


def test_halves_that_add_up_pass_with_their_counts(outcomes) -> None:
    for got in outcomes:
        agreed: Agreement = got["halves"]
        assert agreed.ready and agreed.error is None
        # row- and column-parallel halves; the vocabulary's padding row leaves it unverified
        assert agreed.verified_shards == 2 and agreed.verified_bytes > 0
    assert all(o[f"{name}: in step"] == 3 for o in outcomes for name in _names(outcomes))


def test_one_flipped_byte_fails_every_rank_alike(outcomes) -> None:
    errors = {o["one byte flipped"].error for o in outcomes}
    (error,) = errors
    assert error is not None and error.startswith("row_parallel shard 0 read in parts by 2")
    assert "wsum64" in error


def test_a_rank_without_its_bytes_makes_neither_ready(outcomes) -> None:
    assert all(not o["rank 1 has no bytes"].ready for o in outcomes)


def test_a_rank_that_read_nothing_in_parts_still_agrees(outcomes) -> None:
    first, second = (o["rank 0 read nothing in parts"] for o in outcomes)
    assert first == Agreement(True) and second.ready and second.error is None
    assert second.verified_shards == 0  # its halves alone cover nothing
    assert all(o["not verifying"] == Agreement(True) for o in outcomes)


def _names(outcomes: list[dict[str, Any]]) -> list[str]:
    return [name for name in outcomes[0] if not name.endswith(": in step")]
