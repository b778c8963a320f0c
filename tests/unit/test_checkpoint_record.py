"""The record of a checkpoint's files (`checkpoint_record`): every file's size and SHA-256, and
the seal of the record itself. Plain files, no torch: each case takes milliseconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer_svc.domain import FailedPrecondition
from trainer_svc.runtime.checkpoint_record import (
    SEAL_KEY,
    FileRecord,
    record_files,
    seal,
    unseal,
    verify_files,
)

STATE = "trainer_state.json"
SIZES = {"__0_0.distcp": 3000, ".metadata": 700, "common.pt": 90, "metadata.json": 1, "a/b.pt": 5}


def _directory(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for name, size in SIZES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(rng.bytes(size))
    (root / STATE).write_text("{}")
    return root


def test_the_record_holds_every_file_but_the_state_and_verifies(tmp_path: Path) -> None:
    records = record_files(_directory(tmp_path), leave_out=STATE)
    assert [r.name for r in records] == sorted(SIZES)
    assert {r.name: r.size for r in records} == SIZES
    assert all(len(r.sha256) == 64 for r in records)
    verify_files(tmp_path, records, leave_out=STATE)
    (tmp_path / STATE).write_text("changed: not part of the record")
    verify_files(tmp_path, records, leave_out=STATE)
    assert FileRecord.from_json(records[0].to_json(), "x") == records[0]


@pytest.mark.parametrize("name", sorted(SIZES))
@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_same_size_garbage_anywhere_is_refused(tmp_path: Path, name: str, where: str) -> None:
    records = record_files(_directory(tmp_path), leave_out=STATE)
    data = bytearray((tmp_path / name).read_bytes())
    at = {"start": 0, "middle": len(data) // 2, "end": len(data) - 1}[where]
    data[at] ^= 0x01
    (tmp_path / name).write_bytes(bytes(data))
    with pytest.raises(FailedPrecondition, match="does not match the checksum") as info:
        verify_files(tmp_path, records, leave_out=STATE)
    assert str(tmp_path) in str(info.value) and name in str(info.value)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: (d / "common.pt").unlink(), "common.pt, recorded when it was saved, is missing"),
        (lambda d: (d / "extra").write_bytes(b""), "holds extra, which was not recorded"),
        (lambda d: (d / "a" / "c").write_bytes(b""), "holds a/c, which was not recorded"),
        (lambda d: (d / "common.pt").write_bytes(b"x"), "common.pt has 1 bytes, 90 were recorded"),
        (lambda d: (d / "link").symlink_to(d / "common.pt"), "link, which is not a regular file"),
        (lambda d: (d / "dir-link").symlink_to(d / "a"), "dir-link, which is not a regular"),
    ],
)
def test_a_directory_that_holds_other_files_is_refused(tmp_path: Path, change, match) -> None:
    records = record_files(_directory(tmp_path), leave_out=STATE)
    change(tmp_path)
    with pytest.raises(FailedPrecondition, match=match):
        verify_files(tmp_path, records, leave_out=STATE)


def test_a_sealed_record_opens_and_detects_any_change() -> None:
    content = {"weights_version": 3, "layout": "TP=2", "files": [{"name": "x", "size": 1}]}
    sealed = json.loads(seal(content))
    assert unseal(sealed, "state") == content
    assert unseal(json.loads(json.dumps(sealed, indent=7)), "state") == content  # whitespace
    for edit in (
        {"weights_version": 4},
        {"layout": "TP=1"},
        {"files": []},
        {"extra": 1},
        {SEAL_KEY: "0" * 64},
    ):
        with pytest.raises(FailedPrecondition, match="state is damaged"):
            unseal({**sealed, **edit}, "state")
    with pytest.raises(FailedPrecondition, match="older version"):
        unseal(content, "state")


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ([], "must be an object"),
        ({"size": 1, "sha256": "0" * 64}, "'name' must be"),
        ({"name": "x", "size": -1, "sha256": "0" * 64}, "size of x must be"),
        ({"name": "x", "size": True, "sha256": "0" * 64}, "size of x must be"),
        ({"name": "x", "size": 1, "sha256": "A" * 64}, "64 hex digits"),
    ],
)
def test_a_malformed_file_entry_is_refused(entry: object, match: str) -> None:
    with pytest.raises(FailedPrecondition, match=match):
        FileRecord.from_json(entry, "state")


def test_the_record_needs_no_torch() -> None:
    code = (
        "import sys, trainer_svc.runtime.checkpoint_record, trainer_svc.runtime.checkpoint_files; "
        "print(sorted(m for m in ('torch', 'megatron', 'grpc') if m in sys.modules))"
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "[]"
