"""What loading and exporting an HF checkpoint cost each trainer rank. Loading: the bytes it
reads and its host memory at the worst moment, against the bytes of its own shard, and the time
to SERVING. Exporting (ExportHF, bf16): its host memory peak against the largest tensor, and the
export's throughput against the disk's own (`dd` of the same bytes, flushed, in the same run).

The checkpoint is random, of a real model's shape, in bf16 and split in several files with an
index, as published checkpoints are; the trainer is the deployed service (``trainer-svc`` with
tokens), and each rank reports its own load (``trainer_svc/runtime/rank.py``).

    python -m benchmarks.checkpoint_io --preset 1b --tp 2                  # the CPU machine
    python -m benchmarks.checkpoint_io --preset 8b --tp 2 --device cuda    # a two-GPU machine
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from benchmarks.harness import run_meta, tokens_for, trainer_root, trainer_server
from megatron_hf.convert import hf_names, hf_shape
from megatron_hf.safetensors_file import INDEX_NAME, CheckpointFiles
from megatron_hf.spec import ModelSpec
from trainer_refit.auth import Role
from trainer_svc.client import TrainerClient


@dataclass(frozen=True)
class Shape:
    """A Llama-family model's shape (HF config fields)."""

    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_factor: float
    original_max_position_embeddings: int


PRESETS = {
    # The smoke test's: seconds on a laptop.
    "tiny": Shape(2, 256, 512, 8, 4, 1024, True, 8.0, 128),
    # Llama-3.2-1B (1.24 B parameters, tied).
    "1b": Shape(16, 2048, 8192, 32, 8, 128256, True, 32.0, 8192),
    # Llama-3.1-8B (8.03 B parameters).
    "8b": Shape(32, 4096, 14336, 32, 8, 128256, False, 8.0, 8192),
}

_LOADED = re.compile(
    r"\[rank (?P<rank>\d+)\] INFO loaded HF weights from \S+: read (?P<read>[\d.]+) MiB for a "
    r"share of (?P<share>[\d.]+) MiB in (?P<seconds>[\d.]+) s, host memory peak "
    r"\+(?P<peak>[\d.]+) MiB"
)


def hf_config(shape: Shape) -> dict[str, Any]:
    heads = shape.num_attention_heads
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **{k: v for k, v in asdict(shape).items() if k not in {"rope_factor"}},
        "head_dim": shape.hidden_size // heads,
        "max_position_embeddings": shape.original_max_position_embeddings * 16,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": shape.rope_factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": shape.original_max_position_embeddings,
        },
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
    }


def write_checkpoint(path: Path, shape: Shape, *, files: int, seed: int) -> dict[str, Any]:
    """A random bf16 checkpoint of `shape` in `files` files plus an index; each file's tensors
    are made, written and dropped in turn, so the writer never holds the whole model."""
    config = hf_config(shape)
    spec = ModelSpec.from_hf_config(config)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    names = hf_names(spec)
    sizes = {n: torch.Size(hf_shape(n, spec)).numel() * 2 for n in names}
    total = sum(sizes.values())
    groups: list[list[str]] = [[] for _ in range(files)]
    done = 0
    for name in names:
        groups[min(files - 1, done * files // total)].append(name)
        done += sizes[name]
    generator = torch.Generator().manual_seed(seed)
    weight_map = {}
    for k, group in enumerate(groups, start=1):
        file = f"model-{k:05d}-of-{files:05d}.safetensors"
        tensors = {
            n: (torch.randn(hf_shape(n, spec), generator=generator) * 0.02).to(torch.bfloat16)
            for n in group
        }
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return {"bytes": total, "files": files, "parameters": total // 2}


_EXPORTED = re.compile(
    r"\[rank (?P<rank>\d+)\] INFO wrote this rank's part of the export in (?P<seconds>[\d.]+) s, "
    r"host memory peak \+(?P<peak>[\d.]+) MiB"
)


def dd_seconds(path: Path, nbytes: int) -> float:
    """Seconds for `dd` to write `nbytes` to `path` and flush them, as the export's files are."""
    block = 64 << 20
    started = time.perf_counter()
    subprocess.run(
        [
            "dd",
            "if=/dev/zero",
            f"of={path}",
            f"bs={block}",
            f"count={-(-nbytes // block)}",
            "conv=fdatasync",
            "status=none",
        ],
        check=True,
    )
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def rank_loads(log: str) -> list[dict[str, float]]:
    """Each rank's load, from the trainer's log, in rank order."""
    loads = [{k: float(v) for k, v in m.groupdict().items()} for m in _LOADED.finditer(log)]
    return sorted(loads, key=lambda r: r["rank"])


def measure_import(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model_dir = work / "model"
    started = time.perf_counter()
    written = write_checkpoint(model_dir, PRESETS[args.preset], files=args.files, seed=args.seed)
    written["write_s"] = time.perf_counter() - started
    tokens = tokens_for(work)
    trainer_args = [
        *("--model", str(model_dir), "--tp", str(args.tp), "--device", args.device),
        *("--params-dtype", args.params_dtype, "--max-seq-len", "256"),
        *("--optimizer", args.optimizer),
        *tokens.server_args(),
        *("--work-dir", str(trainer_root(work))),
    ]
    log_path = work / "trainer.log"
    log_path.unlink(missing_ok=True)  # an earlier run's, in the same work dir
    plan = {"trainer_args": trainer_args, "timeout_s": args.timeout}
    auth = tokens.client(Role.ORCHESTRATOR)
    with trainer_server(plan, work, log_path, auth=auth) as (target, serving_s):
        export_dir = trainer_root(work) / "export"
        with TrainerClient(target, auth=auth) as client:
            started = time.perf_counter()
            reply = client.export_hf(export_dir, max_file_bytes=args.export_file_bytes)
            export_s = time.perf_counter() - started
        reloaded = compare(export_dir, model_dir)
        shutil.rmtree(export_dir)
        disk_s = dd_seconds(work / "dd.bin", reply.num_bytes)
    log = log_path.read_text(errors="replace")
    loads = rank_loads(log)
    exports = [{k: float(v) for k, v in m.groupdict().items()} for m in _EXPORTED.finditer(log)]
    if len(loads) != args.tp or len(exports) != args.tp:
        raise RuntimeError(f"expected {args.tp} ranks' load and export lines in {log_path}")
    largest = largest_tensor_mib(PRESETS[args.preset], args.params_dtype)
    for load, export in zip(loads, sorted(exports, key=lambda r: r["rank"]), strict=True):
        load["read_over_share"] = load["read"] / load["share"]
        load["peak_over_share"] = load["peak"] / load["share"]
        load["export_peak"] = export["peak"]
        load["export_peak_over_largest_tensor"] = export["peak"] / largest
    exported = {
        "bytes": reply.num_bytes,
        "seconds": export_s,
        "disk_seconds": disk_s,
        "over_disk": export_s / disk_s,
        "largest_tensor_mib": largest,
        **reloaded,
    }
    return {"checkpoint": written, "serving_s": serving_s, "ranks": loads, "export": exported}


def compare(exported: Path, source: Path) -> dict[str, Any]:
    """The export read back against the checkpoint it was loaded from, one tensor at a time: a
    bf16 checkpoint through float32 or bf16 parameters and back to bf16 is the same bits."""
    with CheckpointFiles(exported) as ours, CheckpointFiles(source) as theirs:
        same_names = set(ours.names()) == set(theirs.names())
        differing = [n for n in theirs.names() if not torch.equal(ours.read(n), theirs.read(n))]
        files = len({e.file for e in ours.entries.values()})
    index = (exported / INDEX_NAME).is_file()
    return {"files": files, "index": index, "bit_exact": same_names and not differing}


def largest_tensor_mib(shape: Shape, params_dtype: str) -> float:
    """The largest parameter in the trainer's dtype: what an export writer holds at once."""
    spec = ModelSpec.from_hf_config(hf_config(shape))
    itemsize = torch.empty(0, dtype=getattr(torch, params_dtype)).element_size()
    return max(torch.Size(hf_shape(n, spec)).numel() for n in hf_names(spec)) * itemsize / 2**20


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--files", type=int, default=4, help="safetensors files to split into")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--params-dtype", default="bfloat16")
    parser.add_argument(
        "--export-file-bytes", type=int, default=1 << 30, help="ExportHF's largest file"
    )
    parser.add_argument(
        "--optimizer",
        choices=("sgd", "adam"),
        default="sgd",
        help="the trainer's (sgd holds no state: the 1b preset's trainer fits a 24 GiB host)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to SERVING")
    parser.add_argument("--work-dir", type=Path, help="keep the checkpoint and logs here")
    parser.add_argument("--out", type=Path, help="results file (JSON)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="checkpoint-io-") as scratch:
        work = (args.work_dir or Path(scratch)).absolute()
        work.mkdir(parents=True, exist_ok=True)
        result = measure_import(args, work)
        if args.work_dir is None:
            shutil.rmtree(work / "model", ignore_errors=True)
    meta = dict(
        run_meta("benchmarks.checkpoint_io", argv),
        config=vars(args) | {"work_dir": None, "out": None},
    )
    print(f"checkpoint: {result['checkpoint']['bytes'] / 2**30:.2f} GiB in {args.files} files")
    print(f"time to SERVING at TP={args.tp}: {result['serving_s']:.1f} s")
    print("rank  share MiB  read/share  peak host memory/share  load s")
    for r in result["ranks"]:
        print(
            f"{int(r['rank']):>4}  {r['share']:>9.1f}  {r['read_over_share']:>10.3f}  "
            f"{r['peak_over_share']:>22.3f}  {r['seconds']:>6.1f}"
        )
    export = result["export"]
    print(
        f"export: {export['files']} files and an index ({export['index']}), equal to the "
        f"checkpoint bit for bit: {export['bit_exact']}"
    )
    print(
        f"export: {export['bytes'] / 2**30:.2f} GiB in {export['seconds']:.1f} s, "
        f"{export['over_disk']:.2f}x dd's {export['disk_seconds']:.1f} s; host memory peak per "
        "rank / largest tensor: "
        + ", ".join(f"{r['export_peak_over_largest_tensor']:.2f}" for r in result["ranks"])
    )
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, **result}, indent=1) + "\n")
        print(f"results: {args.out}")


if __name__ == "__main__":
    sys.exit(main())
