"""Damaged copies of a checkpoint, and the check that loading each is refused and changes
nothing: Forward, ExportHF and the next training step are bit for bit what they were.

`garbled_copies` overwrites part of one file with seeded garbage of the same length, which the
checksums recorded at save catch before any rank reads. `resealed_copies` damages what the
ranks read and then records the files again as they are, so the checksums match and only the
load's staging can refuse them: a stored tensor that one rank alone reads made unreadable, or
NaN, and a tensor's shape changed in the tensor metadata."""

from __future__ import annotations

import io
import pickle
import re
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from tests.support.trainer import TrainerProcess, assert_bit_identical
from trainer_refit.v1 import trainer_pb2 as pb
from trainer_svc.domain import SequenceBatch
from trainer_svc.runtime.checkpoint_files import STATE_FILE, TrainerState
from trainer_svc.runtime.checkpoint_record import record_files

FOREIGN_WORDS = re.compile(
    r"weights_only|Traceback|[Pp]ickl|PytorchStreamReader|zip|\b\w+(Error|Exception)\b"
)
"""What only a third-party exception's text would bring into a refusal (a tensor's name, which
a refusal may give, can hold a torch dtype)."""


def garbled_copies(checkpoint: Path, root: Path, seed: int) -> dict[str, Path]:
    """For every file of `checkpoint`, three copies with a third of it (at least one byte)
    overwritten by seeded random bytes: at its start, in its middle and at its end."""
    rng = np.random.default_rng(seed)
    copies = {}
    for name in sorted(p.name for p in checkpoint.iterdir()):
        size = (checkpoint / name).stat().st_size
        length = max(1, size // 3)
        offsets = {"start": 0, "middle": (size - length) // 2, "end": size - length}
        for where, offset in offsets.items():
            copy = shutil.copytree(checkpoint, root / f"{name}-{where}")
            data = bytearray((copy / name).read_bytes())
            garbage = rng.bytes(length)
            if garbage == bytes(data[offset : offset + length]):  # pragma: no cover
                garbage = bytes(b ^ 0xFF for b in garbage)
            data[offset : offset + length] = garbage
            (copy / name).write_bytes(bytes(data))
            copies[f"{name} garbled at its {where}"] = copy
    return copies


def record_again(checkpoint: Path) -> None:
    """Records the files of `checkpoint` as they are now, as a save would have."""
    state = TrainerState.read(checkpoint)
    files = record_files(checkpoint, leave_out=STATE_FILE)
    (checkpoint / STATE_FILE).write_text(replace(state, files=files).to_json())


def _read_by_one_rank(checkpoint: Path, rank: int) -> tuple[str, str, int, int]:
    """(tensor, file, offset, length) of the largest stored chunk that `rank` wrote of a
    tensor split into several chunks: its TP slice, PP stage or layer, which that rank alone
    reads when DP is 1 (a tensor that other ranks read as well is replicated, a norm: far
    smaller). A refusal's message names the lowest rank that failed, which tests check. Not
    the vocabulary's tensors: megatron loads them whatever their padded size."""
    metadata = FileSystemReader(str(checkpoint)).read_metadata()
    candidates = [
        (info.length, index.fqn, info.relative_path, info.offset)
        for index, info in metadata.storage_data.items()
        if info.relative_path.startswith(f"__{rank}_")
        and len(getattr(metadata.state_dict_metadata[index.fqn], "chunks", ())) > 1
        and not re.search(r"word_embeddings|output_layer", index.fqn)
    ]
    length, fqn, name, offset = max(candidates)
    return fqn, name, offset, length


def resealed_copies(checkpoint: Path, root: Path, rank: int = 1) -> dict[str, Path]:
    """Copies whose damage the recorded checksums cannot see (`record_again`): a chunk that
    `rank` reads made unreadable, or NaN, and that tensor's shape changed in the metadata."""
    fqn, name, offset, length = _read_by_one_rank(checkpoint, rank)

    unreadable = shutil.copytree(checkpoint, root / f"unreadable-on-rank-{rank}")
    with (unreadable / name).open("r+b") as file:
        file.seek(offset)
        file.write(b"\xa5" * 64)  # the chunk's archive header: torch cannot open it

    not_finite = shutil.copytree(checkpoint, root / f"not-finite-on-rank-{rank}")
    with (not_finite / name).open("r+b") as file:
        file.seek(offset)
        tensor = torch.load(io.BytesIO(file.read(length)), weights_only=True)
        stored = io.BytesIO()
        torch.save(torch.full_like(tensor, float("nan")), stored)
        assert len(stored.getvalue()) == length
        file.seek(offset)
        file.write(stored.getvalue())

    wrong_shape = shutil.copytree(checkpoint, root / "wrong-shape")
    metadata = FileSystemReader(str(wrong_shape)).read_metadata()
    tensor_metadata = metadata.state_dict_metadata[fqn]
    size = list(tensor_metadata.size)
    size[-1] += 1
    metadata.state_dict_metadata[fqn] = replace(tensor_metadata, size=torch.Size(size))
    (wrong_shape / ".metadata").write_bytes(pickle.dumps(metadata))

    copies = {
        f"{fqn} unreadable on rank {rank}": unreadable,
        f"{fqn} not finite on rank {rank}": not_finite,
        f"{fqn} of another shape": wrong_shape,
    }
    for copy in copies.values():
        record_again(copy)
    return copies


def refused_load(process: TrainerProcess, path: Path) -> str:
    """LoadCheckpoint of `path` is refused with FAILED_PRECONDITION in the service's own words
    naming the path; returns the message."""
    with pytest.raises(grpc.RpcError) as info:
        process.stub.LoadCheckpoint(pb.LoadCheckpointRequest(path=str(path)))
    details = info.value.details() or ""
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, (path, details)
    assert str(path) in details, details
    assert not FOREIGN_WORDS.search(details), details
    return details


def assert_refusals_change_nothing(
    process: TrainerProcess,
    refused: dict[str, Path],
    train: Callable[[str], object],
    batch: SequenceBatch,
    scratch: Path,
) -> dict[str, str]:
    """Loads each of `refused` (each refused) on the live weights, which must differ from what
    those checkpoints hold; then Forward on `batch`, ExportHF and a step (`train`) equal what
    they give on the live weights without those loads. The reference step needs the live state
    back: it is saved first and loaded again (a load restores it bit for bit). The log of the
    refusals holds no traceback. Returns each refusal's message."""
    client = process.client
    live = scratch / "live"
    client.save_checkpoint(live)
    exported = process.export(f"{scratch.name}-before")
    logprobs = client.forward(batch).logprobs
    train(f"{scratch.name}-reference")
    stepped = process.export(f"{scratch.name}-reference-step")
    client.load_checkpoint(live)
    status = client.status()
    log_start = process.log_path.stat().st_size

    messages = {name: refused_load(process, path) for name, path in refused.items()}

    with process.log_path.open("rb") as log:
        log.seek(log_start)
        assert b"Traceback" not in log.read()
    after = client.status()
    assert (after.weights_version, after.optimizer_step) == (
        status.weights_version,
        status.optimizer_step,
    )
    assert_bit_identical(process.export(f"{scratch.name}-after"), exported)
    np.testing.assert_array_equal(client.forward(batch).logprobs, logprobs)
    train(f"{scratch.name}-after")
    assert_bit_identical(process.export(f"{scratch.name}-after-step"), stepped)
    return messages
