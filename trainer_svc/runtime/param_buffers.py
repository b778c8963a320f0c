"""Contiguous parameter storage, so a snapshot of a rank's weights is one copy per buffer.

Without the distributed optimizer Megatron leaves every parameter in an allocation of its own,
and a snapshot would be one copy per tensor: on a GPU, a launch each, which for a 1B model
costs about as much as the copy itself. Packing them into one buffer per (device,
dtype) when the trainer publishes makes the snapshot a copy or two (`publication`,
`refit_sidecar.publish.slot_layout`). Values, shapes and parameter objects are unchanged; only
`.data` moves. Each parameter starts at an `alignment` boundary, at least the CUDA caching
allocator's 512 bytes, so kernels see the same alignment as before and compute the same bits.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def standalone(param: torch.Tensor) -> bool:
    """Whether the tensor is the whole of its storage (not a view into a shared buffer)."""
    storage = param.untyped_storage()
    return param.data_ptr() == storage.data_ptr() and param.nbytes == storage.nbytes()


@torch.no_grad()
def pack_parameters(parameters: Iterable[torch.nn.Parameter], alignment: int = 512) -> int:
    """Moves the standalone, contiguous parameters into one new buffer per (device, dtype), in
    the order given, and returns how many buffers it made. Parameters that already share a
    buffer (the distributed optimizer's) stay where they are. Call it before the optimizer and
    DDP wrap the model, so nothing holds the old storage."""
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
    seen: set[int] = set()
    for param in parameters:
        if id(param) in seen or not param.is_contiguous() or not standalone(param):
            continue
        seen.add(id(param))
        groups.setdefault((param.device, param.dtype), []).append(param)
    for (device, dtype), params in groups.items():
        step = alignment // torch.empty(0, dtype=dtype).element_size()
        starts, size = [], 0
        for param in params:
            starts.append(size)
            size = -(-(size + param.numel()) // step) * step
        buffer = torch.empty(size, dtype=dtype, device=device)
        for param, start in zip(params, starts, strict=True):
            view = buffer[start : start + param.numel()].view(param.shape)
            view.copy_(param.data)
            param.data = view
    return len(groups)
