"""Lets megatron-core run on CPU ranks (gloo) without editing megatron.

megatron-core assumes CUDA in a few places that matter for a CPU run: explicit ``device="cuda"``
factories in the schedules and gradient clipping, ``torch.cuda.current_device()`` in rotary
embeddings, CUDA streams around gradient sync, the CUDA RNG tracker and the CUDA generator
state activation recompute saves, and
``param.grad.type() == 'torch.cuda.FloatTensor'`` asserts in the optimizer path.

On a machine without CUDA every one of those calls would raise, so redirecting them changes no
behaviour that could otherwise happen. The redirection has two parts, both installed only when
``torch.cuda.is_available()`` is False:

* ``install()`` replaces the process-wide ``torch.cuda`` helpers megatron calls (device, streams,
  RNG, synchronize) with CPU equivalents and installs a CPU RNG tracker for megatron's
  model-parallel RNG forks. Idempotent.
* ``CudaAsCpu`` is a ``TorchFunctionMode`` that maps CUDA device arguments to the CPU and answers
  ``Tensor.type()`` with the CUDA type name. Torch function modes are thread-local, so the rank's
  command thread enters it around each command (``active()``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_state = {"installed": False}


def installed() -> bool:
    return _state["installed"]


def needed() -> bool:
    return not torch.cuda.is_available()


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaAsCpu(TorchFunctionMode):
    """Maps ``device=cuda`` to the CPU and reports CPU float tensors as their CUDA type name."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        return func(*args, **kwargs)


def _in_mode(backward: Any) -> Any:
    """An autograd function's backward run inside `CudaAsCpu`: the autograd engine runs it
    inside the mode's handling of ``torch.autograd.backward``, where the mode is off."""

    def run(ctx: Any, *grads: Any) -> Any:
        with CudaAsCpu():
            return backward(ctx, *grads)

    return staticmethod(run)


def _install_tensor_parallel_backwards() -> None:
    """megatron's tensor-parallel autograd functions (the sequence-parallel gathers and
    scatters, the linears) allocate in their backward on "the current CUDA device"."""
    from megatron.core.tensor_parallel import layers, mappings

    for module in (layers, mappings):
        for value in list(vars(module).values()):
            if (
                isinstance(value, type)
                and issubclass(value, torch.autograd.Function)
                and value.__module__ == module.__name__
                and "backward" in vars(value)
            ):
                value.backward = _in_mode(  # type: ignore[method-assign]
                    vars(value)["backward"].__func__
                )


class _CpuEvent:
    """Stands in for ``torch.cuda.Event``: recorded CPU work has already happened (the MoE
    all-to-all dispatcher waits on one before it reads its split sizes)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuStream:
    """Stands in for ``torch.cuda.Stream``: CPU work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return _CpuEvent() if event is None else event


def _install_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mp_random

    class CpuRNGStatesTracker(mp_random.CudaRNGStatesTracker):
        """Megatron's named RNG streams, kept as CPU generator states."""

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            saved = torch.random.get_rng_state()
            torch.random.manual_seed(seed)
            self.states_[name] = torch.random.get_rng_state()
            torch.random.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name: str = mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise KeyError(f"rng state {name} is not added")
            saved = torch.random.get_rng_state()
            torch.random.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.random.get_rng_state()
                torch.random.set_rng_state(saved)

    mp_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Activation recompute saves the CUDA generator's state beside the CPU generator's and the
    # tracker's, and restores all three before recomputing: a CPU rank has no CUDA generator.
    mp_random._get_cuda_rng_state = _no_cuda_rng_state
    mp_random._set_cuda_rng_state = _set_no_cuda_rng_state


def _no_cuda_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> Any:
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(new_state: Any, device: Any = -1, graph_safe: bool = False) -> None:
    return None


def install() -> None:
    """Redirects megatron's CUDA-only helpers to the CPU. Does nothing when CUDA is available."""
    if _state["installed"] or not needed():
        return
    replacements = {
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "device_count": lambda: 0,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "Stream": _CpuStream,
        "Event": _CpuEvent,
        "current_stream": lambda device=None: _CpuStream(),
        "default_stream": lambda device=None: _CpuStream(),
        "stream": lambda stream=None: contextlib.nullcontext(),
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
    }
    for name, replacement in replacements.items():
        setattr(torch.cuda, name, replacement)
    _install_rng_tracker()
    _install_tensor_parallel_backwards()
    _state["installed"] = True


@contextlib.contextmanager
def active() -> Iterator[None]:
    """Enters ``CudaAsCpu`` for the current thread when CUDA is absent; otherwise a no-op."""
    if not needed():
        yield
        return
    install()
    with CudaAsCpu():
        yield
