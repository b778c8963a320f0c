"""A rank's shard read straight from the checkpoint's files equals the shard of the whole
converted checkpoint bit for bit, reads exactly the bytes the rank holds, and a damaged file is
refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_hf.checkpoint import load_hf_state_dict
from megatron_hf.convert import VOCAB_PADDED, hf_to_megatron, megatron_names
from megatron_hf.safetensors_file import INDEX_NAME, CheckpointFiles
from megatron_hf.shard_reader import check_checkpoint, padding_rows, read_shard
from megatron_hf.sharding import shard
from megatron_hf.spec import ModelFamily, ModelSpec, padded_vocab_size
from megatron_hf.tiny import write_tiny_checkpoint

# Split in several files, in bf16, with four query groups so TP=4 holds one each.
VARIANTS = {
    "llama_tied": {"family": ModelFamily.LLAMA, "tie_word_embeddings": True},
    "qwen2_bias": {"family": ModelFamily.QWEN2},
    "qwen3_qk_norm": {"family": ModelFamily.QWEN3, "head_dim": 24},
    # Expert tensors split over ETP ranks as dense ones over TP ranks (`tp` stands for both).
    "qwen3_moe_experts": {"family": ModelFamily.QWEN3_MOE},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    written = {}
    for name, kwargs in VARIANTS.items():
        args = dict(kwargs)
        family = args.pop("family")
        written[name] = write_tiny_checkpoint(
            tmp_path_factory.mktemp(name),
            family,
            num_attention_heads=8,
            num_key_value_heads=4,
            dtype=torch.bfloat16,
            max_shard_bytes=40_000,
            **args,
        )
    return written


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_shard_read_from_the_files_equals_the_shard_of_the_whole(checkpoints, variant, tp):
    root = checkpoints[variant]
    assert len(json.loads((root / INDEX_NAME).read_text())["weight_map"]) > 0
    assert len(list(root.glob("*.safetensors"))) >= 3
    spec = ModelSpec.from_pretrained_dir(root)
    padded = padded_vocab_size(spec.vocab_size, tp, multiple=64)
    assert padded > spec.vocab_size  # the padding rows are part of what is checked
    whole = hf_to_megatron(load_hf_state_dict(root), spec, padded)
    for rank in range(tp):
        with CheckpointFiles(root) as files:
            check_checkpoint(files, spec)
            held = 0
            for name in megatron_names(spec):
                piece = read_shard(files, name, spec, padded_vocab=padded, tp_rank=rank, tp_size=tp)
                expected = shard(name, whole[name], rank, tp)
                assert piece.dtype == torch.bfloat16, name
                assert torch.equal(piece, expected), (name, rank)
                zeros = padding_rows(name, spec, padded, rank, tp)
                assert (zeros > 0) <= (name in VOCAB_PADDED)
                assert not piece[piece.shape[0] - zeros :].any()
                held += (piece.numel() - zeros * piece[0].numel()) * piece.element_size()
            assert files.bytes_read == held, (rank, files.bytes_read, held)


def test_the_shards_of_all_ranks_read_the_checkpoint_once(checkpoints):
    """Summed over TP ranks, the split tensors are read once and the replicated ones once per
    rank: nothing is read twice by one rank, nothing skipped."""
    root = checkpoints["qwen3_qk_norm"]
    spec = ModelSpec.from_pretrained_dir(root)
    with CheckpointFiles(root) as files:
        total = sum(e.nbytes for e in files.entries.values())
        replicated = sum(e.nbytes for e in files.entries.values() if len(e.shape) == 1)
    padded = padded_vocab_size(spec.vocab_size, 2)
    reads = 0
    for rank in range(2):
        with CheckpointFiles(root) as files:
            for name in megatron_names(spec):
                read_shard(files, name, spec, padded_vocab=padded, tp_rank=rank, tp_size=2)
            reads += files.bytes_read
    assert reads == total + replicated


def _write(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        ({"w": {"dtype": "I8", "shape": [2], "data_offsets": [0, 2]}}, b"ab", "dtype 'I8'"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"abcd", "do not fit"),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"a" * 8, "do not fit"),
    ],
)
def test_a_damaged_file_is_refused_naming_the_tensor(tmp_path, header, data, message):
    _write(tmp_path / "model.safetensors", header, data)
    with pytest.raises(ValueError, match=message):
        CheckpointFiles(tmp_path)


def test_a_file_that_is_not_safetensors_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="not a safetensors file"):
        CheckpointFiles(tmp_path)


def test_an_index_that_disagrees_with_the_files_is_refused(tmp_path):
    header = {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    _write(tmp_path / "a.safetensors", header, b"\0" * 4)
    index = tmp_path / INDEX_NAME
    index.write_text(json.dumps({"weight_map": {"w": "b.safetensors"}}))
    with pytest.raises(ValueError, match=r"lists b\.safetensors, which does not exist"):
        CheckpointFiles(tmp_path)
    _write(tmp_path / "b.safetensors", {}, b"")
    with pytest.raises(ValueError, match="disagrees with the shard contents"):
        CheckpointFiles(tmp_path)


def test_ranges_are_read_as_asked_and_checked(tmp_path):
    tensor = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    raw = tensor.numpy().tobytes()
    _write(
        tmp_path / "m.safetensors",
        {"t": {"dtype": "F32", "shape": [4, 6], "data_offsets": [0, len(raw)]}},
        raw,
    )
    with CheckpointFiles(tmp_path) as files:
        assert torch.equal(files.read("t"), tensor)
        assert torch.equal(files.read_rows("t", 1, 3), tensor[1:3])
        assert torch.equal(files.read_columns("t", 2, 5), tensor[:, 2:5])
        assert files.bytes_read == (24 + 12 + 12) * 4
        with pytest.raises(ValueError, match=r"no range \[3, 7\) along dim 1"):
            files.read_columns("t", 3, 7)
        with pytest.raises(KeyError, match="no tensor u"):
            files.read("u")
