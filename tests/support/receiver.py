"""A direct `Receiver` refitting in a test: the installed tensors, their check against
ExportHF, and a byte of a published shard flipped in the trainer rank's memory."""

from __future__ import annotations

from collections.abc import Iterator

import psutil
import torch

from inference_ext.receiver import Receiver
from inference_ext.refit_options import RefitStats
from tests.support.sidecar import Sidecar
from tests.support.trainer import TrainerProcess


def refit_with_stats(
    receiver: Receiver, version: int
) -> tuple[dict[str, torch.Tensor], RefitStats]:
    """Fetches and installs `version`; the HF tensors installed (copies) and the stats."""
    receiver.fetch(version)
    installed: dict[str, torch.Tensor] = {}
    stats = receiver.install(lambda tensors: installed.update((n, t.clone()) for n, t in tensors))
    return installed, stats


def refit_in_place(
    receiver: Receiver, version: int, targets: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], RefitStats]:
    """Fetches `version` into `targets` (an engine's tensors by HF name, living in staging
    after the layout's first install), installs the rest into them; every HF tensor of the
    version (copies) and the stats."""
    receiver.fetch(version, in_place=targets)

    def install(tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():  # an engine's parameters, too
            for name, tensor in tensors:
                targets[name].copy_(tensor)

    stats = receiver.install(install)
    return {n: t.clone() for n, t in targets.items()}, stats


def assert_exported(trainer: TrainerProcess, installed: dict[str, torch.Tensor], name: str) -> None:
    """`installed` equals the trainer's ExportHF of its current version, bit for bit."""
    exported = trainer.export(name)
    assert set(installed) == set(exported)
    for key, tensor in installed.items():
        assert torch.equal(tensor, torch.from_numpy(exported[key])), key


def corrupt_one_byte(
    sidecar: Sidecar,
    version: int,
    rank: psutil.Process,
    parameter: str = "linear_qkv",
    *,
    shards: int = 2,
) -> str:
    """Flips one byte of a shard (of the first parameter whose name holds `parameter`,
    published by `shards` ranks) that `rank` published for `version`, in the rank's own memory
    (its DRAM snapshot slot), after the version's checksums were reported (a version becomes
    readable a moment after FinishTrainStep returns it)."""
    with sidecar.client() as client:
        client.wait_visible(version)
        manifest = client.manifest(version)
    prefix = f"{rank.name()}-"  # a rank's NIXL agent is named trainer-rank<N>-…, as the rank
    agent = next(a for a in manifest.agents if a.startswith(prefix))
    record = next(p for p in manifest.parameters if len(p.shards) == shards and parameter in p.name)
    (shard,) = [s for s in record.shards if s.location.agent == agent]
    address = shard.location.address + shard.location.nbytes // 3
    (byte,) = read_memory(rank, address, 1)
    write_memory(rank, address, bytes([byte ^ 0x40]))
    return record.name


def read_memory(process: psutil.Process, address: int, nbytes: int) -> bytes:
    """`nbytes` of another process's memory (a trainer rank's DRAM slot or words)."""
    with open(f"/proc/{process.pid}/mem", "rb", buffering=0) as memory:
        memory.seek(address)
        return memory.read(nbytes)


def write_memory(process: psutil.Process, address: int, data: bytes) -> None:
    """Overwrites another process's memory at `address` with `data`."""
    with open(f"/proc/{process.pid}/mem", "r+b", buffering=0) as memory:
        memory.seek(address)
        memory.write(data)
