"""Lets megatron-core's MoE layers run where Transformer Engine or CUDA is absent.

Two gaps in megatron-core 0.16.1, each closed only where it would otherwise raise:

* `moe_utils` imports `te_general_gemm` only when Transformer Engine imports, yet its router
  gating linear reads the name on every call (`te_general_gemm is not None`), so without TE
  the first routed token raises NameError. Binding the name to None takes megatron's own
  torch.mm branch, the one it means for that case.
* The all-to-all token dispatcher turns its split sizes into numpy arrays through
  `maybe_move_tensor_to_cpu(..., as_numpy=True)`, which converts only a CUDA tensor: on a CPU
  rank the sizes stay tensors and `all_to_all_single` refuses them. Without CUDA the
  dispatcher's copy converts CPU tensors too.
* The all-to-all's autograd function allocates its output on `torch.cuda.current_device()`,
  also when the backward pass runs it, where the CPU compatibility layer's torch function mode
  (`cpu_compat.CudaAsCpu`) is not active: without CUDA it runs inside that mode.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer_svc.runtime import cpu_compat

_state = {"cpu": False}


def install() -> None:
    """Idempotent; changes nothing where TE imports and CUDA is available."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if torch.cuda.is_available() or _state["cpu"]:
        return
    token_dispatcher.maybe_move_tensor_to_cpu = _to_cpu_on_cpu
    all_to_all = mappings._AllToAll
    forward = all_to_all.forward

    def forward_on_cpu(ctx: Any, *args: Any) -> Any:
        with cpu_compat.CudaAsCpu():
            return forward(ctx, *args)

    all_to_all.forward = staticmethod(forward_on_cpu)
    _state["cpu"] = True


def _to_cpu_on_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's `maybe_move_tensor_to_cpu` for a rank whose tensors are already on the CPU."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor
