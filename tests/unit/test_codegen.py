"""The committed stubs under trainer_refit/v1 are exactly what protos/ generates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from trainer_refit import codegen

COMMITTED = codegen.REPO_ROOT / "trainer_refit" / "v1"


def test_proto_sources_are_found() -> None:
    names = {p.relative_to(codegen.PROTO_ROOT).as_posix() for p in codegen.proto_files()}
    assert names == {
        "trainer_refit/v1/common.proto",
        "trainer_refit/v1/refit.proto",
        "trainer_refit/v1/trainer.proto",
    }


def test_committed_stubs_equal_freshly_generated_ones(tmp_path: Path) -> None:
    # protoc runs in its own process: in-process it shares native state with whatever the test
    # session loaded before (it has crashed the session after the NIXL tests).
    subprocess.run(
        [sys.executable, "-m", "trainer_refit.codegen", "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    generated = sorted((tmp_path / "trainer_refit").rglob("*_pb2*.py*"))
    generated_names = {p.name for p in generated}
    committed_names = {p.name for p in COMMITTED.glob("*_pb2*.py*")}
    # One .py, .pyi and _grpc.py per .proto, and no stale committed stub without a source.
    assert len(generated_names) == 3 * len(codegen.proto_files())
    assert committed_names == generated_names
    for path in generated:
        assert path.parent == tmp_path / "trainer_refit" / "v1"
        committed = COMMITTED / path.name
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed} differs from what protos/ generates: run `make protos`"
        )
