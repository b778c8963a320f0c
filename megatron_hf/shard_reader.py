"""One TP rank's shard of a Megatron parameter, read straight from an HF checkpoint's files:
only the rows or columns that rank holds are read, then fused as `convert` fuses whole tensors.

The result equals `sharding.shard(name, hf_to_megatron(whole checkpoint)[name], rank, tp)` bit
for bit, without any rank holding the whole checkpoint (tests/megatron_hf/test_mhf_shard_reader.py
holds the two together).
"""

from __future__ import annotations

import torch

from megatron_hf.convert import GLOBAL_RENAMES, VOCAB_PADDED, check_hf_shapes, hf_names_of
from megatron_hf.fused import fuse_gate_up, fuse_qkv
from megatron_hf.safetensors_file import CheckpointFiles
from megatron_hf.sharding import tp_placement
from megatron_hf.spec import ModelSpec


def check_checkpoint(files: CheckpointFiles, spec: ModelSpec) -> None:
    """The checkpoint's tensor names and shapes against the model, from the headers alone."""
    check_hf_shapes({name: entry.shape for name, entry in files.entries.items()}, spec)


def read_shard(
    files: CheckpointFiles,
    megatron_name: str,
    spec: ModelSpec,
    *,
    padded_vocab: int,
    tp_rank: int,
    tp_size: int,
) -> torch.Tensor:
    """TP rank `tp_rank`'s shard of the global (local-spec) Megatron parameter `megatron_name`,
    in the checkpoint's dtype."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
    sources = hf_names_of(megatron_name, spec)
    suffix = megatron_name if megatron_name in GLOBAL_RENAMES else megatron_name.split(".", 3)[3]
    placement = tp_placement(megatron_name)
    if placement.dim is None:
        (source,) = sources
        return files.read(source)
    if suffix.startswith("self_attention.linear_qkv."):
        return _qkv_shard(files, sources, spec, tp_rank, tp_size)
    if megatron_name in VOCAB_PADDED:
        return _vocab_shard(files, sources[0], spec, padded_vocab, rank=tp_rank, tp=tp_size)
    if placement.dim == 0:
        parts = [_row_block(files, s, tp_rank, tp_size, megatron_name) for s in sources]
        return parts[0] if len(parts) == 1 else fuse_gate_up(*parts)
    (source,) = sources
    columns = files.entry(source).shape[1]
    start, stop = _block(columns, tp_rank, tp_size, megatron_name)
    return files.read_columns(source, start, stop)


def _block(size: int, rank: int, parts: int, name: str) -> tuple[int, int]:
    if size % parts:
        raise ValueError(f"{name}: {size} rows or columns do not split into {parts} equal parts")
    per = size // parts
    return rank * per, (rank + 1) * per


def _row_block(
    files: CheckpointFiles, source: str, rank: int, parts: int, name: str
) -> torch.Tensor:
    start, stop = _block(files.entry(source).shape[0], rank, parts, name)
    return files.read_rows(source, start, stop)


def _qkv_shard(
    files: CheckpointFiles, sources: tuple[str, ...], spec: ModelSpec, rank: int, tp: int
) -> torch.Tensor:
    """A rank holds whole query groups: its query heads, then its key and value heads."""
    if spec.num_query_groups % tp:
        raise ValueError(
            f"{spec.num_query_groups} query groups do not split across tensor parallel {tp}"
        )
    groups = spec.num_query_groups // tp
    q_name, k_name, v_name = sources
    q_rows = groups * spec.heads_per_group * spec.head_dim
    kv_rows = groups * spec.head_dim
    q = files.read_rows(q_name, rank * q_rows, (rank + 1) * q_rows)
    k = files.read_rows(k_name, rank * kv_rows, (rank + 1) * kv_rows)
    v = files.read_rows(v_name, rank * kv_rows, (rank + 1) * kv_rows)
    return fuse_qkv(
        q,
        k,
        v,
        num_attention_heads=groups * spec.heads_per_group,
        num_query_groups=groups,
        head_dim=spec.head_dim,
    )


def _vocab_shard(
    files: CheckpointFiles, source: str, spec: ModelSpec, padded: int, *, rank: int, tp: int
) -> torch.Tensor:
    """Rows of the padded vocabulary: those past the checkpoint's vocabulary are zeros, as
    `hf_to_megatron` pads them."""
    start, stop = _block(padded, rank, tp, source)
    real = files.read_rows(source, min(start, spec.vocab_size), min(stop, spec.vocab_size))
    if real.shape[0] == stop - start:
        return real
    out = real.new_zeros((stop - start, *real.shape[1:]))
    out[: real.shape[0]] = real
    return out


def padding_rows(
    megatron_name: str, spec: ModelSpec, padded_vocab: int, tp_rank: int, tp_size: int
) -> int:
    """How many of a rank's rows of `megatron_name` are vocabulary padding (zeros, not read)."""
    if megatron_name not in VOCAB_PADDED:
        return 0
    start, stop = _block(padded_vocab, tp_rank, tp_size, megatron_name)
    return stop - max(start, min(stop, spec.vocab_size))
