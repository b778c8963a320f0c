"""Rank 0's checks of checkpoint and export paths and of checkpoint directories: each bad case
is a typed refusal naming the path, never an OSError or a parse error. The record of a
checkpoint's files on its own: test_checkpoint_record."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

from trainer_svc.domain import FailedPrecondition, InvalidArgument
from trainer_svc.runtime.checkpoint_files import (
    STATE_FILE,
    TrainerState,
    check_checkpoint,
    check_new_directory,
    checked_path,
    make_directory,
)
from trainer_svc.runtime.checkpoint_record import record_files, seal

STATE = TrainerState(weights_version=3, optimizer_step=2, layout="TP=2 PP=1 DP=1 (world size 2)")


def record(path: Path) -> TrainerState:
    """Records the files of `path` as they are, as SaveCheckpoint does last."""
    state = replace(STATE, files=record_files(path, leave_out=STATE_FILE))
    (path / STATE_FILE).write_text(state.to_json())
    return state


def write_checkpoint(path: Path) -> Path:
    """A directory laid out like SaveCheckpoint's: torch_dist shards, megatron's format record
    and common state, then the trainer state recording them."""
    dcp.save({"a": torch.arange(1000.0), "b": torch.ones(7, 3)}, checkpoint_id=str(path))
    save_config(CheckpointingConfig(sharded_backend="torch_dist"), str(path))
    torch.save({}, path / "common.pt")
    record(path)
    return path


def test_paths_must_be_absolute_and_free_of_nul_bytes() -> None:
    with pytest.raises(InvalidArgument, match="NUL"):
        checked_path(Path("/tmp/a\0b"))
    with pytest.raises(InvalidArgument, match="absolute"):
        checked_path(Path("relative/dir"))
    assert checked_path(Path("/tmp/x")) == Path("/tmp/x")


def test_new_directories_that_can_be_used(tmp_path: Path) -> None:
    check_new_directory(tmp_path / "missing" / "nested", "checkpoint")
    (tmp_path / "empty").mkdir()
    check_new_directory(tmp_path / "empty", "export")


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("non-empty", "is not empty"),
        ("a file", "exists and is not a directory"),
        ("below a file", "a-file is not a directory"),
        ("below a device", "/dev/null is not a directory"),
        ("name too long", "cannot use"),
    ],
)
def test_new_directories_that_cannot_be_used(tmp_path: Path, case: str, match: str) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    (tmp_path / "a-file").write_text("")
    paths = {
        "non-empty": tmp_path / "full",
        "a file": tmp_path / "a-file",
        "below a file": tmp_path / "a-file" / "ckpt",
        "below a device": Path("/dev/null/ckpt"),
        "name too long": tmp_path / ("x" * 300) / "ckpt",
    }
    with pytest.raises(FailedPrecondition, match=match):
        check_new_directory(paths[case], "checkpoint")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to read-only directories")
def test_new_directory_below_a_read_only_directory(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(FailedPrecondition, match="read-only"):
        check_new_directory(locked / "ckpt", "checkpoint")


def test_make_directory_turns_os_errors_into_refusals(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(FailedPrecondition, match="cannot create the export directory"):
        make_directory(tmp_path / "a-file" / "export", "export")
    make_directory(tmp_path / "new" / "export", "export")
    assert (tmp_path / "new" / "export").is_dir()


def test_trainer_state_round_trip(tmp_path: Path) -> None:
    (tmp_path / STATE_FILE).write_text(STATE.to_json())
    assert TrainerState.read(tmp_path) == STATE


FILE = {"name": "a.distcp", "size": 3, "sha256": "0" * 64}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", "not valid JSON"),
        ("\udcff{", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"weights_version": 1, "optimizer_step": 1, "layout": "x"}', "older version"),
        (seal({"weights_version": 1, "layout": "x", "files": []}), "'optimizer_step' must be"),
        (seal({"weights_version": 1, "optimizer_step": -2, "layout": "x", "files": []}), "-2"),
        (seal({"weights_version": True, "optimizer_step": 1, "layout": "x", "files": []}), "True"),
        (seal({"weights_version": 1, "optimizer_step": 1, "files": []}), "'layout' must be"),
        (seal({"weights_version": 1, "optimizer_step": 1, "layout": "x"}), "'files' must be"),
        (
            seal({"weights_version": 1, "optimizer_step": 1, "layout": "x", "files": [FILE] * 2}),
            "names a file twice",
        ),
        (
            seal(
                {
                    "weights_version": 1,
                    "optimizer_step": 1,
                    "layout": "x",
                    "files": [{**FILE, "sha256": "x"}],
                }
            ),
            "64 hex digits",
        ),
    ],
)
def test_unusable_trainer_state_is_refused(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / STATE_FILE).write_text(text, errors="surrogateescape")
    with pytest.raises(FailedPrecondition, match=match):
        TrainerState.read(tmp_path)


def test_a_complete_checkpoint_passes(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "ckpt")
    state = check_checkpoint(path)
    assert replace(state, files=()) == STATE
    assert sorted(f.name for f in state.files) == sorted(
        p.name for p in path.iterdir() if p.name != STATE_FILE
    )


def test_a_trainer_state_that_was_edited_is_refused(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "ckpt")
    data = json.loads((path / STATE_FILE).read_text())
    data["optimizer_step"] = 3
    (path / STATE_FILE).write_text(json.dumps(data))
    with pytest.raises(FailedPrecondition, match="does not match its own checksum"):
        check_checkpoint(path)


def _shard(path: Path) -> Path:
    (shard,) = path.glob("*.distcp")
    return shard


def _garble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


BREAKAGES = {
    "no trainer state": (lambda p: (p / STATE_FILE).unlink(), f"{STATE_FILE} missing"),
    "no format record": (
        lambda p: (p / "metadata.json").unlink(),
        "metadata.json, recorded when it was saved, is missing",
    ),
    "corrupt format record": (
        lambda p: (p / "metadata.json").write_text("{"),
        "metadata.json has 1 bytes",
    ),
    "no common state": (lambda p: (p / "common.pt").unlink(), "common.pt, recorded"),
    "common state garbled": (lambda p: _garble(p / "common.pt"), "content of common.pt"),
    "no tensor metadata": (lambda p: (p / ".metadata").unlink(), r"\.metadata, recorded"),
    "tensor metadata garbled": (lambda p: _garble(p / ".metadata"), r"content of \.metadata"),
    "missing shard": (lambda p: _shard(p).unlink(), r"\.distcp, recorded when it was saved"),
    "truncated shard": (
        lambda p: _shard(p).write_bytes(_shard(p).read_bytes()[:64]),
        r"\.distcp has 64 bytes, \d+ were recorded",
    ),
    "shard garbled": (lambda p: _garble(_shard(p)), r"content of __0_0\.distcp does not match"),
    "a file added": (lambda p: (p / "extra.pt").write_bytes(b""), "extra.pt, which was not"),
    "a symlink": (lambda p: (p / "link").symlink_to(p / "common.pt"), "not a regular file"),
}


@pytest.mark.parametrize("name", BREAKAGES)
def test_a_damaged_or_incomplete_checkpoint_is_refused(tmp_path: Path, name: str) -> None:
    path = write_checkpoint(tmp_path / "ckpt")
    breakage, match = BREAKAGES[name]
    breakage(path)
    with pytest.raises(FailedPrecondition, match=match) as info:
        check_checkpoint(path)
    assert str(path) in str(info.value)


RECORDED_BREAKAGES = {
    "no format record": (lambda p: (p / "metadata.json").unlink(), "metadata.json"),
    "corrupt format record": (
        lambda p: (p / "metadata.json").write_text("{"),
        "metadata.json is not readable",
    ),
    "no common state": (lambda p: (p / "common.pt").unlink(), "common.pt is missing"),
    "no tensor metadata": (
        lambda p: (p / ".metadata").unlink(),
        "tensor metadata cannot be read",
    ),
    "corrupt tensor metadata": (
        lambda p: (p / ".metadata").write_bytes(b"garbage"),
        "tensor metadata is corrupt",
    ),
    "missing shard": (lambda p: _shard(p).unlink(), "shard file .* is missing"),
    "truncated shard": (
        lambda p: _shard(p).write_bytes(_shard(p).read_bytes()[:64]),
        "has 64 bytes, its metadata needs",
    ),
}


@pytest.mark.parametrize("name", RECORDED_BREAKAGES)
def test_an_incomplete_checkpoint_whose_record_matches_is_refused(
    tmp_path: Path, name: str
) -> None:
    """The checks behind the checksums, for files recorded as they are (a save that wrote an
    incomplete checkpoint): megatron's format record, common state and every shard."""
    path = write_checkpoint(tmp_path / "ckpt")
    breakage, match = RECORDED_BREAKAGES[name]
    breakage(path)
    record(path)
    with pytest.raises(FailedPrecondition, match=match) as info:
        check_checkpoint(path)
    assert str(path) in str(info.value)
