"""Checkpoint and export paths are confined to the configured roots: `..`, symlinks that lead
out (also ones planted inside a root), and look-alike prefixes are refused with a message naming
the path and the roots; what stays inside resolves to its real path."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer_svc.cli import parse_config
from trainer_svc.config import TrainerConfig
from trainer_svc.domain import FailedPrecondition, InvalidArgument, PathNotAllowed
from trainer_svc.runtime.path_roots import PathRoots


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    """Two roots, a directory beside them, and a look-alike of the first root's name."""
    dirs = {name: tmp_path / name for name in ("root", "second", "outside", "root-evil")}
    for directory in dirs.values():
        directory.mkdir()
    return dirs


def _roots(layout: dict[str, Path]) -> PathRoots:
    return PathRoots.resolved([layout["root"], layout["second"]])


def test_paths_inside_a_root_resolve_to_themselves(layout: dict[str, Path]) -> None:
    roots = _roots(layout)
    assert roots.confine(layout["root"] / "ckpt" / "step-1") == layout["root"] / "ckpt" / "step-1"
    assert roots.confine(layout["second"] / "export") == layout["second"] / "export"
    assert roots.confine(layout["root"]) == layout["root"]


def test_a_relative_path_lies_under_the_first_root(layout: dict[str, Path]) -> None:
    assert _roots(layout).confine(Path("ckpt/step-1")) == layout["root"] / "ckpt" / "step-1"


@pytest.mark.parametrize(
    "relative",
    ["../outside/ckpt", "ckpt/../../outside", "ckpt/../step-1", ".."],
)
def test_dot_dot_is_refused_even_when_it_stays_inside(
    layout: dict[str, Path], relative: str
) -> None:
    roots = _roots(layout)
    for path in (Path(relative), layout["root"] / relative):
        with pytest.raises(PathNotAllowed, match=r"'\.\.' component") as info:
            roots.confine(path)
        assert str(layout["root"]) in str(info.value)


def test_paths_outside_every_root_are_refused_naming_path_and_roots(
    layout: dict[str, Path],
) -> None:
    roots = _roots(layout)
    for path in (layout["outside"] / "ckpt", Path("/etc/trainer"), Path("/")):
        with pytest.raises(PathNotAllowed) as info:
            roots.confine(path)
        message = str(info.value)
        assert str(path) in message
        assert str(layout["root"]) in message and str(layout["second"]) in message


def test_a_name_sharing_a_roots_prefix_is_outside(layout: dict[str, Path]) -> None:
    with pytest.raises(PathNotAllowed, match="outside the allowed roots"):
        _roots(layout).confine(layout["root-evil"] / "ckpt")


def test_a_symlink_inside_a_root_that_leads_out_is_refused(layout: dict[str, Path]) -> None:
    (layout["root"] / "escape").symlink_to(layout["outside"])
    (layout["root"] / "dangling").symlink_to(layout["outside"] / "missing")
    roots = _roots(layout)
    for path in (layout["root"] / "escape", layout["root"] / "escape" / "ckpt"):
        with pytest.raises(PathNotAllowed, match="resolves to") as info:
            roots.confine(path)
        assert str(layout["outside"]) in str(info.value)
    with pytest.raises(PathNotAllowed):
        roots.confine(Path("dangling/ckpt"))


def test_a_symlink_that_stays_inside_resolves_to_its_target(layout: dict[str, Path]) -> None:
    target = layout["second"] / "checkpoints"
    target.mkdir()
    (layout["root"] / "latest").symlink_to(target)
    assert _roots(layout).confine(layout["root"] / "latest" / "step-2") == target / "step-2"


def test_roots_are_kept_as_their_real_paths(layout: dict[str, Path], tmp_path: Path) -> None:
    alias = tmp_path / "alias"
    alias.symlink_to(layout["root"])
    roots = PathRoots.resolved([alias])
    assert roots.roots == (layout["root"],)
    assert roots.confine(alias / "ckpt") == layout["root"] / "ckpt"


def test_nul_bytes_are_an_invalid_argument(layout: dict[str, Path]) -> None:
    with pytest.raises(InvalidArgument, match="NUL"):
        _roots(layout).confine(Path(f"{layout['root']}/a\0b"))


def test_a_long_path_is_cut_in_the_message(layout: dict[str, Path]) -> None:
    path = layout["outside"] / ("x" * 5000)
    with pytest.raises(PathNotAllowed) as info:
        _roots(layout).confine(path)
    assert len(str(info.value)) < 1000 and "characters" in str(info.value)


def test_the_refusal_is_a_failed_precondition_to_code_that_catches_those() -> None:
    assert issubclass(PathNotAllowed, FailedPrecondition)


def test_roots_must_be_absolute() -> None:
    with pytest.raises(ValueError, match="absolute"):
        PathRoots.resolved([Path("relative")])
    with pytest.raises(ValueError, match="at least one"):
        PathRoots(())


def test_the_work_dir_is_the_default_root(tmp_path: Path) -> None:
    assert TrainerConfig(work_dir=tmp_path).checkpoint_roots() == (tmp_path,)
    explicit = TrainerConfig(work_dir=tmp_path, path_roots=(Path("/data/a"), Path("/data/b")))
    assert explicit.checkpoint_roots() == (Path("/data/a"), Path("/data/b"))
    with pytest.raises(ValueError, match="no path roots"):
        TrainerConfig().checkpoint_roots()


def test_path_root_flags_are_repeatable_and_must_be_absolute(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--path-root", "/data/a", "--path-root", "/data/b"]
    config, _ = parse_config([*flags, "--insecure"])
    assert config.path_roots == (Path("/data/a"), Path("/data/b"))
    with pytest.raises(SystemExit) as info:
        parse_config(["--path-root", "relative", "--insecure"])
    assert info.value.code == 2
    assert "--path-root must be an absolute directory" in capsys.readouterr().err


def test_the_engine_takes_only_paths_confined_already(layout: dict[str, Path]) -> None:
    """Rank 0's precheck: every rank acts on the command's path as it is, so it must be the
    absolute real path the servicer confined (`Checkpointer.confine`)."""
    from trainer_svc.runtime.checkpointing import Checkpointer

    checkpointer = Checkpointer(None, _roots(layout))
    (layout["root"] / "latest").symlink_to(layout["second"])
    confined = checkpointer.confine(Path("latest/step-1"))
    assert confined == layout["second"] / "step-1"
    checkpointer.check_savable(confined)
    checkpointer.check_exportable(confined)
    with pytest.raises(InvalidArgument, match="absolute"):
        checkpointer.check_savable(Path("latest/step-1"))
    with pytest.raises(PathNotAllowed, match="pass the resolved path"):
        checkpointer.check_exportable(layout["root"] / "latest" / "step-1")
    with pytest.raises(PathNotAllowed, match="outside the allowed roots"):
        checkpointer.check_loadable(layout["outside"])
