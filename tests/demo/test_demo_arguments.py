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
