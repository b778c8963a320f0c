"""A progress word mirrored in a file of shared memory (`refit_sidecar/pull/shared_word.py`)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from refit_sidecar.pull.progress import PROGRESS_BYTES, CopyProgress, OwnProgress, ProgressWord
from refit_sidecar.pull.shared_word import (
    FILE_BYTES,
    ProgressFile,
    ProgressFileReader,
    ProgressFileRef,
    host_id,
)

pytestmark = pytest.mark.skipif(not host_id(), reason="this host has no boot id")


def test_a_reader_on_the_host_sees_every_store_in_order_and_the_file_goes_with_close(
    tmp_path: Path,
) -> None:
    mirror = ProgressFile.create(str(tmp_path))
    assert mirror is not None
    assert mirror.ref.host == host_id() and mirror.ref.check() is None
    assert os.stat(mirror.ref.path).st_size == FILE_BYTES
    own = OwnProgress("parent", mirror=mirror)
    reader = ProgressFileReader.open(mirror.ref)
    assert reader is not None
    own.start(5)
    assert ProgressWord.decode(reader.read()) == ProgressWord(5, 0, CopyProgress.FILLING)
    own.filled(4096)
    own.finish(CopyProgress.COMPLETE)
    # The file says what the word in registered memory says.
    assert (
        ProgressWord.decode(reader.read())
        == own.read()
        == ProgressWord(5, 4096, CopyProgress.COMPLETE)
    )
    own.close()
    assert not os.path.exists(mirror.ref.path)
    # A reader that held it open keeps the last word; a new one finds nothing.
    assert ProgressWord.decode(reader.read()).state is CopyProgress.COMPLETE
    reader.close()
    assert ProgressFileReader.open(mirror.ref) is None


def test_a_reader_opens_only_a_progress_file_of_its_own_host(tmp_path: Path) -> None:
    mirror = ProgressFile.create(str(tmp_path))
    assert mirror is not None
    path = mirror.ref.path
    # Another host's file, however named, is not this host's.
    assert ProgressFileReader.open(ProgressFileRef("another-host", path)) is None
    # A path a peer offers must name a progress file; a link or a file of another size is
    # refused even when it is named as one.
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * FILE_BYTES)
    assert ProgressFileRef(host_id(), str(secret)).check() is not None
    assert ProgressFileReader.open(ProgressFileRef(host_id(), str(secret))) is None
    link = tmp_path / f"trainer-refit-progress.1.{os.getpid()}.{'0' * 16}"
    link.symlink_to(path)
    assert ProgressFileRef(host_id(), str(link)).check() is None
    assert ProgressFileReader.open(ProgressFileRef(host_id(), str(link))) is None
    short = tmp_path / f"trainer-refit-progress.1.{os.getpid()}.{'1' * 16}"
    short.write_bytes(b"\0" * PROGRESS_BYTES)
    assert ProgressFileReader.open(ProgressFileRef(host_id(), str(short))) is None
    assert ProgressFileRef(host_id(), "relative/" + os.path.basename(path)).check() is not None
    assert ProgressFileRef("", path).check() is not None
    mirror.close()


def _file_of_a_process(directory: Path, *, then: str) -> str:
    """The path of the file a Python process made in `directory`, holding it until it ran
    `then` and ended."""
    code = (
        "import sys; from refit_sidecar.pull.shared_word import ProgressFile; "
        f"f = ProgressFile.create(sys.argv[1]); print(f.ref.path, flush=True); {then}"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(directory)], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_files_of_processes_gone_are_removed_when_a_new_one_is_made(tmp_path: Path) -> None:
    # A process that ends without running its exit handlers (as one killed would).
    gone = _file_of_a_process(tmp_path, then="import os; os._exit(0)")
    assert os.path.exists(gone)
    mine = ProgressFile.create(str(tmp_path))
    assert mine is not None
    assert not os.path.exists(gone)
    assert os.path.exists(mine.ref.path)
    other = ProgressFile.create(str(tmp_path))  # a live process's file (this one's) stays
    assert other is not None and os.path.exists(mine.ref.path)
    # A file of another PID namespace: its pid means nothing here, so it stays.
    foreign = tmp_path / f"trainer-refit-progress.1.{2**22 + 17}.{'2' * 16}"
    foreign.write_bytes(b"\0" * FILE_BYTES)
    ProgressFile.create(str(tmp_path)).close()  # type: ignore[union-attr]
    assert foreign.exists()
    mine.close()
    other.close()


def test_a_process_that_exits_without_closing_its_file_removes_it(tmp_path: Path) -> None:
    """An engine's worker is shut down by its engine and exits without closing its receiver:
    its file goes with the process, whether it exits as a program or as a multiprocessing
    child; a forked child never removes its parent's file."""
    left = _file_of_a_process(tmp_path, then="")
    assert left and not os.path.exists(left)
    parents = ProgressFile.create(str(tmp_path))
    assert parents is not None
    context = multiprocessing.get_context("fork")
    paths = context.Queue()
    child = context.Process(target=_make_and_exit, args=(str(tmp_path), paths))
    child.start()
    child.join(timeout=30)
    assert child.exitcode == 0
    childs = paths.get(timeout=5)
    assert not os.path.exists(childs)
    assert os.path.exists(parents.ref.path)
    parents.close()
    assert not os.path.exists(parents.ref.path)


def _make_and_exit(directory: str, paths: Any) -> None:
    made = ProgressFile.create(directory)
    assert made is not None
    paths.put(made.ref.path)


def test_no_directory_means_no_file_and_the_word_alone() -> None:
    assert ProgressFile.create("/nonexistent-directory-for-progress") is None
