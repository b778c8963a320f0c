"""What a checkpoint directory held when SaveCheckpoint wrote it: each file's size and SHA-256.

SaveCheckpoint records every file of the directory (megatron's shards, tensor metadata, format
record and common state, whatever else it wrote) in `trainer_state.json`, and seals that record
with a SHA-256 over its own canonical JSON (`seal`). A load first checks that the directory
holds exactly the recorded files, each of its recorded size and content (`verify_files`), so
same-size garbage anywhere, in any file, is refused before a rank reads a byte of it.

The digests detect damage (a bad disk, a truncated copy, a stray write), not a malicious
writer: whoever can rewrite a shard can rewrite the record and its seal too. Torch-free: plain
files and hashlib, unit-tested in milliseconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer_svc.domain import FailedPrecondition

SEAL_KEY = "record_sha256"
"""The key of a record's digest of its own content."""
_HEX_DIGITS = frozenset("0123456789abcdef")
_HASH_THREADS = 8


@dataclass(frozen=True, kw_only=True)
class FileRecord:
    """One file of a checkpoint: its path relative to the checkpoint directory (POSIX
    separators), its size in bytes and the SHA-256 of its content (hex)."""

    name: str
    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "sha256": self.sha256}

    @classmethod
    def from_json(cls, data: object, where: str) -> FileRecord:
        """`where` names the record in messages (the state file)."""
        if not isinstance(data, dict):
            raise FailedPrecondition(f"{where}: each entry of 'files' must be an object")
        name, size, digest = data.get("name"), data.get("size"), data.get("sha256")
        if not isinstance(name, str) or not name:
            raise FailedPrecondition(f"{where}: a file's 'name' must be a non-empty string")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise FailedPrecondition(f"{where}: the size of {name} must be an integer >= 0")
        if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= _HEX_DIGITS:
            raise FailedPrecondition(f"{where}: the sha256 of {name} must be 64 hex digits")
        return cls(name=name, size=size, sha256=digest)


def _canonical(content: dict[str, Any]) -> bytes:
    return json.dumps(content, sort_keys=True, separators=(",", ":")).encode()


def seal(content: dict[str, Any]) -> str:
    """`content` as indented JSON with `SEAL_KEY` added: the SHA-256 of its canonical form
    (sorted keys, no whitespace), so a change to any value, key or the JSON itself shows."""
    assert SEAL_KEY not in content
    digest = hashlib.sha256(_canonical(content)).hexdigest()
    return json.dumps({**content, SEAL_KEY: digest}, indent=2)


def unseal(data: dict[str, Any], where: str) -> dict[str, Any]:
    """`data` without its seal, once the seal matches; `where` names the file in messages.
    A record without a seal was written before checkpoints recorded their content."""
    recorded = data.get(SEAL_KEY)
    if recorded is None:
        raise FailedPrecondition(
            f"{where} records no content checksums: the checkpoint was written by an older "
            "version of the trainer and cannot be verified; load it with that version and "
            "save it again with this one"
        )
    content = {k: v for k, v in data.items() if k != SEAL_KEY}
    if recorded != hashlib.sha256(_canonical(content)).hexdigest():
        raise FailedPrecondition(f"{where} is damaged: it does not match its own checksum")
    return content


def _sha256(path: Path) -> str:
    # hashlib releases the GIL while it hashes a large buffer, so threads hash files at once.
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _hash_all(directory: Path, names: Iterable[str]) -> dict[str, str]:
    """{name: sha256} of the files, several at once: a checkpoint has a shard file or more per
    rank, and hashing them one after another would leave the disk and all cores but one idle."""
    names = list(names)
    workers = max(1, min(_HASH_THREADS, os.cpu_count() or 1, len(names)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="checkpoint-sha256") as pool:
        digests = pool.map(lambda name: _sha256(directory / name), names)
        return dict(zip(names, digests, strict=True))


def list_files(directory: Path, *, leave_out: str) -> dict[str, int]:
    """{relative POSIX path: size} of every file under `directory` but `leave_out` (the record
    itself). Anything that is neither a regular file nor a directory (a symlink, a device) is
    refused: a checkpoint is plain files, and a link could lead outside the path roots."""
    found: dict[str, int] = {}
    for root, dirs, files in os.walk(directory, followlinks=False):
        base = Path(root)
        for name in [*dirs, *files]:
            path = base / name
            relative = path.relative_to(directory).as_posix()
            mode = path.lstat().st_mode
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode):
                raise FailedPrecondition(
                    f"{directory} holds {relative}, which is not a regular file: a checkpoint "
                    "directory holds only the files SaveCheckpoint wrote"
                )
            if relative != leave_out:
                found[relative] = path.stat().st_size
    return found


def record_files(directory: Path, *, leave_out: str) -> tuple[FileRecord, ...]:
    """The record of every file under `directory` but `leave_out`, sorted by name."""
    sizes = list_files(directory, leave_out=leave_out)
    digests = _hash_all(directory, sorted(sizes))
    return tuple(
        FileRecord(name=name, size=sizes[name], sha256=digest) for name, digest in digests.items()
    )


def verify_files(directory: Path, records: tuple[FileRecord, ...], *, leave_out: str) -> None:
    """`directory` holds exactly the recorded files (but `leave_out`), each of its recorded
    size and SHA-256; else FailedPrecondition naming the directory and the first file at
    fault. Sizes are compared first, so a truncated file costs no hashing."""
    sizes = list_files(directory, leave_out=leave_out)
    recorded = {r.name: r for r in records}
    missing = sorted(recorded.keys() - sizes.keys())
    if missing:
        raise FailedPrecondition(
            f"{directory} is incomplete: {missing[0]}, recorded when it was saved, is missing"
        )
    unknown = sorted(sizes.keys() - recorded.keys())
    if unknown:
        raise FailedPrecondition(
            f"{directory} holds {unknown[0]}, which was not recorded when it was saved: a "
            "checkpoint directory holds only the files SaveCheckpoint wrote"
        )
    for name in sorted(sizes):
        if sizes[name] != recorded[name].size:
            raise FailedPrecondition(
                f"{directory} is damaged: {name} has {sizes[name]} bytes, "
                f"{recorded[name].size} were recorded when it was saved"
            )
    digests = _hash_all(directory, sorted(sizes))
    for name, digest in digests.items():
        if digest != recorded[name].sha256:
            raise FailedPrecondition(
                f"{directory} is damaged: the content of {name} does not match the checksum "
                "recorded when it was saved"
            )
