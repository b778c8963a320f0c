"""Paths and files of checkpoints and exports, checked before any rank acts on them.

Rank 0 runs these checks in `StepEngine.precheck`, so a path that cannot be used or a
directory that holds no complete checkpoint is refused while nothing has changed. Every
filesystem or parse error becomes `InvalidArgument` (the path itself is malformed) or
`FailedPrecondition` (the filesystem does not allow it), with a message in our words naming
the path and the file, never a parser's own text.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from trainer_svc.domain import FailedPrecondition, InvalidArgument
from trainer_svc.runtime.checkpoint_record import FileRecord, seal, unseal, verify_files

STATE_FILE = "trainer_state.json"
MEGATRON_CONFIG_FILE = "metadata.json"
"""Written by megatron's dist_checkpointing: which format the shards are in."""


@dataclass(frozen=True, kw_only=True)
class TrainerState:
    """`trainer_state.json`: written last by SaveCheckpoint, so its presence marks a complete
    checkpoint. It records every other file of the checkpoint (`checkpoint_record`) and is
    sealed by a digest of its own content."""

    weights_version: int
    optimizer_step: int
    layout: str
    files: tuple[FileRecord, ...] = ()
    """Every other file of the checkpoint directory as SaveCheckpoint wrote it."""

    def to_json(self) -> str:
        return seal(
            {
                "weights_version": self.weights_version,
                "optimizer_step": self.optimizer_step,
                "layout": self.layout,
                "files": [f.to_json() for f in self.files],
            }
        )

    @classmethod
    def read(cls, directory: Path) -> TrainerState:
        path = directory / STATE_FILE
        with filesystem_errors(f"cannot read {path}"):
            text = path.read_text(errors="replace")
        try:
            data = json.loads(text)
        except ValueError:
            raise FailedPrecondition(f"{path} is not valid JSON") from None
        if not isinstance(data, dict):
            raise FailedPrecondition(f"{path} must hold a JSON object")
        data = unseal(data, str(path))
        layout = data.get("layout")
        if not isinstance(layout, str):
            raise FailedPrecondition(f"{path}: 'layout' must be a string")
        files = data.get("files")
        if not isinstance(files, list):
            raise FailedPrecondition(f"{path}: 'files' must be a list")
        records = tuple(FileRecord.from_json(f, str(path)) for f in files)
        if len({r.name for r in records}) != len(records):
            raise FailedPrecondition(f"{path}: 'files' names a file twice")
        return cls(
            weights_version=_count(data, "weights_version", path),
            optimizer_step=_count(data, "optimizer_step", path),
            layout=layout,
            files=records,
        )


def _count(data: dict, name: str, path: Path) -> int:
    value = data.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise FailedPrecondition(f"{path}: {name!r} must be an integer >= 0, got {value!r}")
    return value


@contextmanager
def filesystem_errors(action: str) -> Iterator[None]:
    """Turns an OSError (or a path with a NUL byte) into FailedPrecondition: `action: why`."""
    try:
        yield
    except InvalidArgument:
        raise
    except OSError as e:
        why = e.strerror or "the filesystem refused"  # the OS's words, not Python's
        raise FailedPrecondition(f"{action}: {why}") from e
    except ValueError as e:
        # os functions reject embedded NUL bytes with ValueError; any other ValueError here
        # is not the request's fault and stays a fault (its text is not for the client).
        if "null byte" not in str(e):
            raise
        raise InvalidArgument(f"{action}: the path contains a NUL byte") from e


def checked_path(path: Path) -> Path:
    """An absolute path without NUL bytes (which no filesystem call accepts)."""
    if "\0" in str(path):
        raise InvalidArgument(f"paths must not contain NUL bytes, got {str(path)!r}")
    if not path.is_absolute():
        raise InvalidArgument(f"checkpoint and export paths must be absolute, got {str(path)!r}")
    return path


def check_new_directory(path: Path, what: str) -> None:
    """`path` is an empty directory, or a missing one whose nearest existing ancestor is a
    writable directory (so rank 0 can create it)."""
    path = checked_path(path)
    with filesystem_errors(f"cannot use {path} for the {what}"):
        if path.exists():
            if not path.is_dir():
                raise FailedPrecondition(f"{path} exists and is not a directory")
            if any(path.iterdir()):
                raise FailedPrecondition(
                    f"{path} is not empty; choose a new directory for the {what}"
                )
            existing = path
        else:
            existing = next(p for p in path.parents if p.exists())
            if not existing.is_dir():
                raise FailedPrecondition(
                    f"cannot create the {what} directory {path}: {existing} is not a directory"
                )
        if not os.access(existing, os.W_OK | os.X_OK):
            raise FailedPrecondition(f"cannot write the {what} to {path}: {existing} is read-only")


def make_directory(path: Path, what: str) -> None:
    with filesystem_errors(f"cannot create the {what} directory {path}"):
        path.mkdir(parents=True, exist_ok=True)


def check_checkpoint(path: Path) -> TrainerState:
    """`path` holds a checkpoint as SaveCheckpoint wrote it: its sealed trainer state, exactly
    the files that records, each of the recorded size and checksum, then (parsed only once
    verified) megatron's format record and every shard file its tensor metadata names, each as
    long as the metadata says."""
    path = checked_path(path)
    with filesystem_errors(f"cannot read the checkpoint {path}"):
        if not (path / STATE_FILE).is_file():
            raise FailedPrecondition(
                f"{path} holds no trainer checkpoint ({STATE_FILE} missing); "
                "pass a directory written by SaveCheckpoint"
            )
        state = TrainerState.read(path)
        verify_files(path, state.files, leave_out=STATE_FILE)
        _check_megatron_config(path)
        _check_shards(path)
    return state


def _check_megatron_config(path: Path) -> None:
    from megatron.core.dist_checkpointing.core import maybe_load_config
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

    try:
        config = maybe_load_config(str(path))
    except (ValueError, TypeError):
        raise FailedPrecondition(f"{path / MEGATRON_CONFIG_FILE} is not readable") from None
    if config is None:
        raise FailedPrecondition(
            f"{path} is incomplete: {MEGATRON_CONFIG_FILE} (the shards' format) is missing"
        )
    if not (path / COMMON_STATE_FNAME).is_file():
        raise FailedPrecondition(f"{path} is incomplete: {COMMON_STATE_FNAME} is missing")


def _check_shards(path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except OSError as e:
        raise FailedPrecondition(
            f"{path} is incomplete: its tensor metadata cannot be read ({e.strerror or e})"
        ) from e
    except Exception:  # a truncated or foreign file fails to unpickle in many ways
        raise FailedPrecondition(f"{path} is incomplete: its tensor metadata is corrupt") from None
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise FailedPrecondition(f"{path} is incomplete: shard file {name} is missing")
        actual = shard.stat().st_size
        if actual < size:
            raise FailedPrecondition(
                f"{path} is incomplete: shard file {name} has {actual} bytes, "
                f"its metadata needs {size}"
            )
