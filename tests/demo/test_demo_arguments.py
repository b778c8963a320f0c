"""The demo's command line: `--model` names a local HF checkpoint (the short run in
test_rl_demo uses it), and a directory that is not one is refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.rl_loop import build_parser, main


def test_help_says_how_to_point_the_loop_at_a_checkpoint() -> None:
    text = build_parser().format_help()
    assert "--model MODEL" in text and "local HF checkpoint directory" in text


def test_a_model_directory_without_a_config_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(tmp_path), "--workdir", str(tmp_path / "run")])
    assert exit_.value.code == 2
    assert f"--model {tmp_path}: no config.json there" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_groups_routing_reaches_the_trainers_batch_with_a_row_for_each_last_token() -> None:
    """The MoE variant's wiring (the run itself: `test_rl_demo`, slow): each answer's routing
    as its engine reported it (its prompt and every answer token but the last) becomes the
    batch's `routed_experts`, a row added for the answer's last token, which no forward read."""
    import numpy as np

    from examples.reverse_task import Prompt
    from examples.rl_loop import Group, grpo_batch

    prompt = Prompt(tokens=[5, 6, 7], word="ab")
    completions = [[8, 9], [10, 11, 12]]
    routing = [
        np.arange(len(prompt.tokens) + len(c) - 1)[:, None, None] * np.ones((1, 2, 2), np.int64)
        for c in completions
    ]
    group = Group(prompt, completions, [[-0.1] * len(c) for c in completions], [0.0, 1.0], routing)
    batch = grpo_batch(group)
    assert batch is not None and batch.routed_experts is not None
    assert batch.routed_experts.shape == (batch.num_tokens, 4)
    for i, completion in enumerate(completions):
        rows = batch.routed_experts[batch.offsets[i] : batch.offsets[i + 1]]
        assert np.array_equal(rows[:-1], routing[i].reshape(len(routing[i]), -1))
        assert not rows[-1].any()
        assert len(rows) == len(prompt.tokens) + len(completion)
