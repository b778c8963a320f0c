"""benchmarks.trainer_step's data and summary: a length mix draws each sequence's length within
its bounds, the step's token counts come from the batches themselves, and runs of two sequence
layouts are summarized under their own names with the packed/padded tokens/s ratio."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from benchmarks.trainer_step import layout_runs, make_batches, step_tokens, summarize, variant

PLAN: dict[str, Any] = dict(seed=7, seqs_per_microbatch=6, microbatches=3, vocab=50, seq_len=40)


def test_a_length_mix_draws_lengths_within_its_bounds_deterministically() -> None:
    plan = dict(PLAN, length_mix=(5, 40))
    batches = make_batches(plan)
    lengths = np.concatenate([b.lengths() for b in batches])
    assert len(lengths) == 18 and lengths.min() >= 5 and lengths.max() <= 40
    assert len(set(lengths.tolist())) > 3  # mixed, not one length
    again = make_batches(plan)
    assert all(np.array_equal(a.tokens, b.tokens) for a, b in zip(batches, again, strict=True))
    # Every token but each sequence's first is trained on.
    for b in batches:
        assert b.loss_mask is not None
        assert not b.loss_mask[b.offsets[:-1]].any()
        assert b.loss_mask.sum() == b.num_tokens - b.num_sequences


def test_step_tokens_count_the_batches_tokens() -> None:
    assert step_tokens(PLAN) == (3 * 6 * 40, 3 * 6 * 39)
    plan = dict(PLAN, length_mix=(5, 40))
    sent = sum(b.num_tokens for b in make_batches(plan))
    assert step_tokens(plan) == (sent, sent - 18)


def _run(mode: str, layout: str, layouts: list[str], step_s: float) -> dict[str, Any]:
    records = [
        dict(warmup=i == 0, seconds=step_s, begin_s=0.0, microbatch_s=[0.0], finish_s=0.0, loss=1.0)
        for i in range(3)
    ]
    return dict(
        mode=mode,
        variant=variant(mode, layout, layouts),
        layout=layout,
        records=records,
        startup_s=1.0,
        num_parameters=10,
        data_checksum=1,
    )


def test_two_layouts_are_summarized_apart_with_their_ratio() -> None:
    layouts = ["packed", "padded"]
    runs = [_run("inprocess", "packed", layouts, 0.5), _run("inprocess", "padded", layouts, 0.8)]
    summary = summarize(runs, PLAN)
    assert set(summary["modes"]) == {"inprocess-packed", "inprocess-padded"}
    assert summary["packed_over_padded"] == {"inprocess": pytest.approx(0.8 / 0.5)}
    assert summary["tokens_per_step"] == 3 * 6 * 40
    # One layout keeps the plain mode names.
    single = summarize([_run("inprocess", "auto", ["auto"], 0.5)], PLAN)
    assert set(single["modes"]) == {"inprocess"} and single["packed_over_padded"] == {}


def test_each_packed_row_kernel_runs_once_and_padded_once() -> None:
    runs = dict(layout_runs(["packed", "padded"], ["cudnn", "flash"]))
    assert runs == {
        "packed-cudnn": ["--sequence-layout", "packed", "--packed-attention", "cudnn"],
        "packed-flash": ["--sequence-layout", "packed", "--packed-attention", "flash"],
        "padded": ["--sequence-layout", "padded", "--packed-attention", "cudnn"],
    }
    names = list(runs)
    summary = summarize(
        [
            _run("inprocess", "packed-cudnn", names, 0.4),
            _run("inprocess", "packed-flash", names, 0.5),
            _run("inprocess", "padded", names, 0.8),
        ],
        PLAN,
    )
    assert summary["packed_over_padded"] == {
        "inprocess-cudnn": pytest.approx(0.8 / 0.4),
        "inprocess-flash": pytest.approx(0.8 / 0.5),
    }
    # One kernel keeps the layouts' plain names.
    assert dict(layout_runs(["packed", "padded"], ["auto"])).keys() == {"packed", "padded"}
