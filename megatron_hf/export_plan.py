"""Where every tensor of an exported HF checkpoint goes: which file, at which offset, written by
which pipeline stage.

Every rank computes the same plan from the model's shape alone, so the stages write their own
files in parallel, each file's header is written before its first tensor, and the index is known
before any tensor is: no rank gathers the model or waits to learn another stage's sizes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megatron_hf.convert import hf_names_of, hf_shape, megatron_names
from megatron_hf.sharding import stage_of
from megatron_hf.spec import ModelSpec

DEFAULT_FILE_BYTES = 5 * 1024**3
"""The largest file of an export, as transformers shards by default."""


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    begin: int
    """Offset of its data within the file's data section."""
    end: int


@dataclass(frozen=True)
class PlannedFile:
    name: str
    stage: int
    """The pipeline stage that holds, and so writes, every tensor of the file."""
    tensors: tuple[PlannedTensor, ...]

    @property
    def nbytes(self) -> int:
        return self.tensors[-1].end if self.tensors else 0


@dataclass(frozen=True)
class ExportPlan:
    files: tuple[PlannedFile, ...]

    def weight_map(self) -> dict[str, str]:
        return {t.name: f.name for f in self.files for t in f.tensors}

    @property
    def total_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def main_dtype(self) -> torch.dtype:
        """The dtype of most of the bytes: the one the exported config names."""
        bytes_of: dict[torch.dtype, int] = {}
        for t in (t for f in self.files for t in f.tensors):
            bytes_of[t.dtype] = bytes_of.get(t.dtype, 0) + t.end - t.begin
        return max(bytes_of, key=lambda d: bytes_of[d])

    def files_of(self, stage: int) -> list[PlannedFile]:
        return [f for f in self.files if f.stage == stage]


def plan_export(
    spec: ModelSpec,
    *,
    pipeline_parallel: int,
    dtype: torch.dtype | Mapping[str, torch.dtype],
    max_file_bytes: int = DEFAULT_FILE_BYTES,
) -> ExportPlan:
    """The files of an export in HF parameter order: each stage's tensors fill files of at most
    `max_file_bytes` (a larger tensor gets a file of its own), and no file spans two stages.
    `dtype`: every tensor's, or each Megatron parameter's (its HF tensors take it)."""
    if max_file_bytes <= 0:
        raise ValueError(f"max_file_bytes must be positive, got {max_file_bytes}")
    by_stage: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [
        [] for _ in range(pipeline_parallel)
    ]
    for megatron_name in megatron_names(spec):
        stage = stage_of(megatron_name, spec.num_layers, pipeline_parallel)
        kind = dtype if isinstance(dtype, torch.dtype) else dtype[megatron_name]
        by_stage[stage] += [(h, hf_shape(h, spec), kind) for h in hf_names_of(megatron_name, spec)]
    groups: list[tuple[int, list[tuple[str, tuple[int, ...], torch.dtype]]]] = []
    for stage, tensors in enumerate(by_stage):
        size = max_file_bytes  # forces a new file for the stage's first tensor
        for tensor in tensors:
            nbytes = math.prod(tensor[1]) * tensor[2].itemsize
            if size + nbytes > max_file_bytes and size:
                groups.append((stage, []))
                size = 0
            groups[-1][1].append(tensor)
            size += nbytes
    files = []
    for k, (stage, tensors) in enumerate(groups, start=1):
        planned, offset = [], 0
        for name, shape, kind in tensors:
            end = offset + math.prod(shape) * kind.itemsize
            planned.append(PlannedTensor(name, shape, kind, offset, end))
            offset = end
        name = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        files.append(PlannedFile(name, stage, tuple(planned)))
    return ExportPlan(tuple(files))
