"""Reading and writing HF safetensors checkpoints (weights + config + tokenizer files)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from megatron_hf.convert import hf_names, hf_shape
from megatron_hf.safetensors_file import INDEX_NAME, CheckpointFiles
from megatron_hf.spec import ModelSpec

WEIGHTS_NAME = "model.safetensors"
# Copied next to the weights when the config source is a checkpoint directory.
SIDECAR_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def load_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint dir (sharded with an index, or *.safetensors files)."""
    with CheckpointFiles(path) as files:
        return {name: files.read(name) for name in files.names()}


def save_hf_checkpoint(
    path: str | Path, hf_state: Mapping[str, torch.Tensor], config_source_dir_or_config: Any
) -> Path:
    """Write model.safetensors + config.json into `path`; returns `path`.

    The config source is an HF checkpoint dir (its config, generation config and tokenizer files
    are copied), a PretrainedConfig, a config.json dict, or a ModelSpec. The weights must be
    exactly the model's HF parameters (a tied `lm_head.weight` is dropped).
    """
    root = Path(path)
    source = config_source_dir_or_config
    source_dir = Path(source) if isinstance(source, str | os.PathLike) else None
    config = _config_dict(source, source_dir)
    spec = ModelSpec.from_hf_config(config)
    tensors = _validated(hf_state, spec)

    root.mkdir(parents=True, exist_ok=True)
    stale = [p.name for p in root.glob("*.safetensors") if p.name != WEIGHTS_NAME]
    if stale or (root / INDEX_NAME).exists():
        raise ValueError(
            f"{root} already holds other weight files {stale or [INDEX_NAME]}; "
            "write into an empty directory"
        )
    tmp = root / (WEIGHTS_NAME + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, root / WEIGHTS_NAME)
    (root / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if source_dir is not None:
        for name in SIDECAR_FILES:
            src = source_dir / name
            if src.is_file() and src.resolve() != (root / name).resolve():
                shutil.copyfile(src, root / name)
    return root


def _config_dict(source: Any, source_dir: Path | None) -> dict[str, Any]:
    if source_dir is not None:
        config_path = source_dir / "config.json"
        if not config_path.is_file():
            raise ValueError(f"no config.json in {source_dir}; expected an HF checkpoint dir")
        return dict(json.loads(config_path.read_text()))
    if isinstance(source, ModelSpec):
        return source.to_hf_config()
    if isinstance(source, Mapping):
        return dict(source)
    if hasattr(source, "to_json_string"):  # transformers PretrainedConfig
        return dict(json.loads(source.to_json_string(use_diff=False)))
    raise ValueError(
        f"config source must be a checkpoint dir, a PretrainedConfig, a dict or a ModelSpec; "
        f"got {type(source).__name__}"
    )


def _validated(hf_state: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    names = hf_names(spec)
    extra = set(hf_state) - set(names) - ({"lm_head.weight"} if spec.tie_word_embeddings else set())
    missing = [n for n in names if n not in hf_state]
    if missing or extra:
        raise ValueError(
            f"HF state does not match the config: missing {missing[:5]}, "
            f"unexpected {sorted(extra)[:5]}"
        )
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name in names:
        tensor = hf_state[name].detach().cpu()
        if tuple(tensor.shape) != hf_shape(name, spec):
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, expected {hf_shape(name, spec)}"
            )
        # safetensors refuses views and shared storage (e.g. split q/k/v, trimmed vocab).
        storage = tensor.untyped_storage()
        if (
            not tensor.is_contiguous()
            or storage.nbytes() != tensor.nbytes
            or storage.data_ptr() in seen
        ):
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        seen.add(tensor.untyped_storage().data_ptr())
        out[name] = tensor
    return out
