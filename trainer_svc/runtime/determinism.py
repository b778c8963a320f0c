"""`--deterministic`: a step's losses and weights are bit-identical from run to run.

Without it, a GPU step is reproducible only up to rounding: cuBLAS may split a matrix
product's reduction differently with its workspace, the embedding's and the attention's
backward passes accumulate with atomics in whatever order threads arrive, and cuDNN picks
algorithms by timing. With it, torch runs only deterministic algorithms (raising on an op that
has none rather than running it), cuBLAS gets the fixed workspace its deterministic mode needs,
cuDNN neither benchmarks nor picks non-deterministic kernels, and megatron-core's
`deterministic_mode` looks the vocabulary-parallel embedding up by indexing instead of
`F.embedding` (whose backward uses atomics). The CPU runs are deterministic either way.

Collectives are left as they are: NCCL's reduction order is fixed for a given world, message
size and algorithm, which one run and the next share.
"""

from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE = ":4096:8"
"""cuBLAS's documented setting for reproducible results (one 4 MiB workspace per stream, eight
of them); it must be in the environment before the first cuBLAS handle is made."""


def apply(deterministic: bool) -> None:
    """Chooses deterministic or fast algorithms for this process. Call before any CUDA work."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = False
