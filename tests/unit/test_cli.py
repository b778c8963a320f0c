"""trainer-svc's command line: defaults, typed values, and usage errors for invalid ones."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainer_svc.cli import build_parser, parse_config
from trainer_svc.config import (
    Device,
    OptimizerKind,
    PackedAttention,
    ParallelLayout,
    ParamsDType,
    ReferenceConfig,
    ReferencePlacement,
    ReferenceWeights,
    SequenceLayout,
    TrainerConfig,
)


def test_defaults_are_the_config_defaults() -> None:
    config, log_level = parse_config(["--insecure"])
    assert config == TrainerConfig()
    assert log_level == "INFO"
    assert config.layout.world_size == 1


def test_parser_defaults_match_the_config_classes() -> None:
    args = build_parser().parse_args([])
    defaults = TrainerConfig()
    assert args.lr == defaults.optimizer.learning_rate
    assert args.port == defaults.server.port
    assert args.max_microbatch_tokens == defaults.server.max_microbatch_tokens
    assert args.seed == defaults.seed
    assert args.vocab_multiple == defaults.model.vocab_multiple


def test_every_flag_is_parsed_into_typed_config(tmp_path: Path) -> None:
    config, log_level = parse_config(
        [
            "--insecure",
            *("--model", str(tmp_path / "hf")),
            *("--params-dtype", "bfloat16"),
            *("--max-seq-len", "512"),
            *("--vocab-multiple", "64"),
            *("--tp", "2", "--pp", "3", "--dp", "4"),
            *("--device", "cpu"),
            *("--optimizer", "sgd", "--lr", "3e-4", "--weight-decay", "0.01"),
            *("--max-grad-norm", "0"),
            *("--host", "127.0.0.1", "--port", "0", "--port-file", str(tmp_path / "port")),
            *("--max-microbatch-tokens", "4096"),
            *("--seed", "7", "--work-dir", str(tmp_path / "work")),
            *("--log-level", "DEBUG"),
            *("--refit-publish-every", "3"),
            *("--reference-policy", "initial", "--reference-placement", "host"),
            *("--sequence-layout", "packed", "--packed-attention", "flash"),
        ]
    )
    assert log_level == "DEBUG"
    assert config.model.hf_path == tmp_path / "hf"
    assert config.model.params_dtype is ParamsDType.BFLOAT16
    assert config.model.max_sequence_length == 512
    assert config.model.vocab_multiple == 64
    assert config.model.sequence_layout is SequenceLayout.PACKED
    assert config.model.packed_attention is PackedAttention.FLASH
    assert config.layout == ParallelLayout(tensor_parallel=2, pipeline_parallel=3, data_parallel=4)
    assert config.layout.world_size == 24
    assert config.layout.describe() == "TP=2 PP=3 DP=4 (world size 24)"
    assert config.device is Device.CPU
    assert config.optimizer.kind is OptimizerKind.SGD
    assert config.optimizer.learning_rate == 3e-4
    assert config.optimizer.weight_decay == 0.01
    assert config.optimizer.max_grad_norm == 0.0
    assert config.server.host == "127.0.0.1"
    assert config.server.port == 0
    assert config.server.port_file == tmp_path / "port"
    assert config.server.max_microbatch_tokens == 4096
    assert config.seed == 7
    assert config.work_dir == tmp_path / "work"
    assert config.refit.publish_every == 3
    assert config.reference == ReferenceConfig(
        weights=ReferenceWeights.INITIAL, placement=ReferencePlacement.HOST
    )


@pytest.mark.parametrize(
    ("tp", "pp", "dp", "world"), [(1, 1, 8, 8), (2, 1, 1, 2), (2, 2, 2, 8), (4, 2, 1, 8)]
)
def test_layout_world_size(tp: int, pp: int, dp: int, world: int) -> None:
    config, _ = parse_config(["--insecure", "--tp", str(tp), "--pp", str(pp), "--dp", str(dp)])
    assert config.layout.world_size == world


INVALID = [
    (["--tp", "0"], "tensor_parallel must be >= 1, got 0"),
    (["--pp", "0"], "pipeline_parallel must be >= 1, got 0"),
    (["--dp", "-2"], "data_parallel must be >= 1, got -2"),
    (["--port", "70000"], r"port must be in \[0, 65535\], got 70000"),
    (["--port", "-1"], r"port must be in \[0, 65535\], got -1"),
    (["--lr", "-0.001"], "learning_rate must be a finite value >= 0"),
    (["--weight-decay", "-0.1"], "weight_decay must be a finite value >= 0"),
    (["--max-grad-norm", "-1"], "max_grad_norm must be a finite value >= 0"),
    (["--vocab-multiple", "0"], "vocab_multiple must be >= 1"),
    (["--max-seq-len", "1"], "max_sequence_length must be >= 2"),
    (["--max-microbatch-tokens", "0"], "max_microbatch_tokens >= 1"),
    (["--refit-publish-every", "0"], "publish_every must be >= 1, got 0"),
    (["--params-dtype", "float16"], "argument --params-dtype: invalid choice: 'float16'"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--optimizer", "lion"], "argument --optimizer: invalid choice: 'lion'"),
    (["--log-level", "TRACE"], "argument --log-level: invalid choice: 'TRACE'"),
    (["--tp", "two"], "argument --tp: invalid int value: 'two'"),
    (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--dp", "2", "--ep", "4"], r"expert parallel 4 x expert tensor parallel 1 = 4 does not"),
    (["--moe-aux-loss-coeff", "-1"], "load-balancing loss coefficient must be finite and >= 0"),
]


@pytest.mark.parametrize(("argv", "message"), INVALID, ids=[" ".join(a) for a, _ in INVALID])
def test_invalid_values_exit_with_a_usage_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_config(["--insecure", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: trainer-svc")
    assert re.search(message, err), err


@pytest.mark.parametrize(
    "argv",
    [["--lr", "nan"], ["--weight-decay", "nan"], ["--max-grad-norm", "nan"], ["--lr", "inf"]],
    ids=" ".join,
)
def test_non_finite_optimizer_values_exit_with_a_usage_error(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_config(["--insecure", *argv])
    assert info.value.code == 2


def test_a_given_work_dir_is_used_and_no_scratch_dir_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank gets its launcher's work dir: it makes no scratch directory, so one killed
    without cleanup leaves none behind; without one, a scratch directory lives for the run."""
    from trainer_svc.__main__ import work_dir

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    given, _ = parse_config(["--insecure", "--work-dir", str(tmp_path / "work")])
    with work_dir(given) as work:
        assert work == tmp_path / "work"
        assert list(scratch.iterdir()) == []
    default, _ = parse_config(["--insecure"])
    with work_dir(default) as work:
        assert work.parent == scratch and work.name.startswith("trainer-svc-") and work.is_dir()
    assert not work.exists()


def test_expert_flags_are_parsed_into_the_layout_and_model_config() -> None:
    config, _ = parse_config(
        ["--insecure", "--dp", "4", "--ep", "2", "--etp", "2", "--moe-aux-loss-coeff", "0.01"]
    )
    assert (config.layout.expert_parallel, config.layout.expert_tensor_parallel) == (2, 2)
    assert config.layout.expert_data_parallel == 1
    assert config.model.experts.aux_loss_coeff == 0.01
