"""Wheels for running the benchmarks and GPU tests on an offline CUDA host whose Python (3.12)
already has torch (CUDA 13), transformers, safetensors, tokenizers and numpy: the rest of what
the services import, as cp312 manylinux wheels, into one directory (default `.whl`).

Wheels larger than `--recompress-above` MB are rewritten as LZMA zips of the same files (pip
installs identical files), which keeps the set small enough to copy alongside the repository:
`nixl_cu13` is 58.8 MB as published and about 35 MB recompressed.

    python3 scripts/gpu_wheelhouse.py            # then, on the host:
    source scripts/gpu_env.sh                    # installs them into /tmp/site
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

PINS = (
    "megatron-core==0.19.2",
    "grpcio==1.85.1",
    "grpcio-health-checking==1.85.1",
    "grpcio-reflection==1.85.1",
    "grpcio-status==1.85.1",
    "protobuf==7.36.2",
    "googleapis-common-protos==1.76.0",
    "nixl==1.5.1",
    "nixl-cu13==1.5.1",
    "psutil==7.2.2",
    "nvidia-cudnn-frontend==1.16.0",
    "pytest==9.2.0",
    "pluggy==1.7.0",
    "iniconfig==2.3.1",
)
"""megatron-core is newer than the CPU pin (the CPU venv keeps the version its tests cover);
protobuf >= 7.35.1 for the generated stubs; grpcio >= 1.85.1 for health, reflection and
status; grpcio-status and googleapis-common-protos for rich error details; cuDNN's frontend
for packed rows' ragged attention (it loads the cuDNN torch ships); pytest and its two
dependencies for the GPU tests."""
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")


def download(dest: Path, python_version: str) -> None:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", python_version, "--implementation", "cp"]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    command += ["-d", str(dest), *PINS]
    subprocess.run(command, check=True)


def recompress(wheel: Path) -> int:
    """Rewrites `wheel` as an LZMA zip of the same members; returns the bytes saved."""
    before = wheel.stat().st_size
    tmp = wheel.with_suffix(".lzma-tmp")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(tmp, "w", zipfile.ZIP_LZMA) as out:
        for info in source.infolist():
            out.writestr(info, source.read(info), zipfile.ZIP_LZMA)
    tmp.replace(wheel)
    return before - wheel.stat().st_size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=Path(".whl"))
    parser.add_argument("--python-version", default="3.12")
    parser.add_argument("--recompress-above", type=float, default=40.0, help="MB")
    args = parser.parse_args(argv)
    args.dest.mkdir(parents=True, exist_ok=True)
    download(args.dest, args.python_version)
    for wheel in sorted(args.dest.glob("*.whl")):
        if wheel.stat().st_size > args.recompress_above * 1e6:
            saved = recompress(wheel)
            print(f"{wheel.name}: recompressed, {saved / 1e6:.1f} MB smaller")
    total = sum(w.stat().st_size for w in args.dest.glob("*.whl"))
    print(f"{args.dest}: {len(list(args.dest.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
