"""Installing a refit's experts straight into vLLM's fused expert parameters.

vLLM's in-place reload would load experts through its per-expert weight loader (a Python call
per expert and projection), and it does not make the engine compute with them: a reload
re-runs the unquantized method's processing as a weight update, which copies the loaded
weights into the kernel's tensors without the kernel's own post-load step, so the CPU
kernel's tensors, prepacked into its grouped-GEMM layout at the first load, would get weights
in vLLM's plain layout. Here a refit hands each layer's w13 and w2 (vLLM's plain layout,
assembled from three pulled boxes: `expert_slices.py`) to the processing a first load runs
(the backend's kernel format, then the kernel's post-load step), on the layer itself with the
new weights swapped in for the call, and copies the result into the tensors the engine
computes with: their storage and addresses stay (CUDA graphs stay valid).

`FusedExperts.find` checks at initialisation that the engine holds its experts the way
`slices.expert_share` says (vLLM's parallel config per layer, linear placement, no redundant
experts, no padding) and that the processing gives tensors of the engine's shapes, so a
refit never fails half-installed for a layout reason.
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from inference_ext.expert_slices import ExpertTarget, FusedExpertTensor, parse_target
from inference_ext.refit_options import RefitError
from inference_ext.slices import ReceiverLayout, UnsupportedLayout, expert_share
from megatron_hf.spec import ModelSpec

log = logging.getLogger(__name__)

Weights = Iterator[tuple[str, torch.Tensor]]

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_UNSUPPORTED_BACKENDS = ("TPU", "OOT", "XPU", "MOONEP")
"""Unquantized MoE backends whose processing is not the kernel format plus the kernel's
post-load step on the layer's own tensors (TPU and out-of-tree handle it themselves, XPU
transposes first, MoonEP keeps tensors outside the layer)."""


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's expert module and the shapes of its plain (unprocessed) tensors."""

    index: int
    name: str
    module: Any
    """vLLM's expert module (`RoutedExperts` in 0.32): its parameters and processing."""
    w13_shape: tuple[int, int, int]
    w2_shape: tuple[int, int, int]


class FusedExperts:
    """The engine's expert layers, by decoder layer index."""

    def __init__(self, layers: dict[int, _Layer]) -> None:
        self._layers = layers

    @classmethod
    def find(cls, model: torch.nn.Module, spec: ModelSpec, layout: ReceiverLayout) -> FusedExperts:
        """The expert layers of `model`, checked (RefitError naming what differs)."""
        try:
            share = expert_share(spec, layout)
        except UnsupportedLayout as e:
            raise RefitError(str(e)) from None
        hidden = spec.hidden_size
        layers: dict[int, _Layer] = {}
        problems: list[str] = []
        for name, module in model.named_modules():
            if not hasattr(module, "w13_weight") or not hasattr(module, "quant_method"):
                continue
            match = _LAYER_RE.search(f".{name}.")
            if match is None or int(match[1]) in layers:
                problems.append(f"{name}: not the one expert module of a decoder layer")
                continue
            w13 = (share.num_experts, 2 * share.width_size, hidden)
            w2 = (share.num_experts, hidden, share.width_size)
            layer = _Layer(int(match[1]), name, module, w13, w2)
            problems += _layer_problems(layer, layout)
            layers[layer.index] = layer
        missing = sorted(set(range(spec.num_layers)) - set(layers))
        if missing:
            problems.append(f"no fused experts found for layers {missing}")
        if problems:
            raise RefitError("the engine's experts differ from refit's: " + "; ".join(problems[:4]))
        experts = cls(layers)
        experts._check_processing(layers[0])
        return experts

    def _check_processing(self, layer: _Layer) -> None:
        """Process zeros of the plain shapes once: the result must fit the engine's tensors
        (and the backend's processing must run at all), or refit refuses now."""
        live = (layer.module.w13_weight, layer.module.w2_weight)
        try:
            w13, w2 = _processed(
                layer.module,
                torch.zeros(layer.w13_shape, dtype=live[0].dtype, device=live[0].device),
                torch.zeros(layer.w2_shape, dtype=live[1].dtype, device=live[1].device),
            )
        except Exception as e:
            raise RefitError(
                f"{layer.name}: vLLM's processing of refit experts failed: {type(e).__name__}: {e}"
            ) from e
        for got, param, what in ((w13, live[0], "w13"), (w2, live[1], "w2")):
            if got.shape != param.shape or got.dtype != param.dtype:
                raise RefitError(
                    f"{layer.name}: processed {what} is {tuple(got.shape)} {got.dtype}, the "
                    f"engine computes with {tuple(param.shape)} {param.dtype}"
                )

    def install(self, weights: Weights, reload: Callable[[Weights], None]) -> None:
        """Hand `weights` up to the first expert target to `reload` (the HF tensors: every
        expert target comes after them), then install the experts a layer at a time, each
        layer's w13 and w2 together."""
        pending: list[tuple[str, torch.Tensor]] = []

        def before_experts() -> Weights:
            for name, tensor in weights:
                if parse_target(name) is not None:
                    pending.append((name, tensor))
                    return
                yield name, tensor

        modules = frozenset(type(layer.module).__name__ for layer in self._layers.values())
        with _quiet_about_experts(modules):
            reload(before_experts())
        held: dict[int, torch.Tensor] = {}
        installed = set()
        for name, tensor in itertools.chain(pending, weights):
            target = parse_target(name)
            if target is None:
                raise RefitError(f"{name} came after the expert tensors (it was not installed)")
            if target.tensor is FusedExpertTensor.W13:
                held[target.layer] = tensor
                continue
            w13 = held.pop(target.layer, None)
            if w13 is None:
                raise RefitError(f"{name} came without its layer's w13")
            self._install(target, w13, tensor)
            installed.add(target.layer)
        if held or installed != set(self._layers):
            missing = sorted(set(self._layers) - installed)
            raise RefitError(f"the experts of layers {missing} were not handed over")

    def _install(self, target: ExpertTarget, w13: torch.Tensor, w2: torch.Tensor) -> None:
        layer = self._layers[target.layer]
        if w13.shape != layer.w13_shape or w2.shape != layer.w2_shape:
            raise RefitError(
                f"{layer.name}: got w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)}, expected "
                f"{layer.w13_shape} and {layer.w2_shape}"
            )
        live13, live2 = layer.module.w13_weight, layer.module.w2_weight
        processed13, processed2 = _processed(layer.module, w13.to(live13.dtype), w2.to(live2.dtype))
        with torch.no_grad():
            live13.data.copy_(processed13)
            live2.data.copy_(processed2)


def _layer_problems(layer: _Layer, layout: ReceiverLayout) -> list[str]:
    """How `layer` differs from what refit installs into: vLLM's parallel config of its
    experts, their placement and count, and their shapes before processing."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    module, name = layer.module, layer.name
    method = module.quant_method
    if not isinstance(method, UnquantizedFusedMoEMethod):
        return [f"{name}: refit installs unquantized experts, not {type(method).__name__}"]
    backend = method.unquantized_backend.name
    if backend in _UNSUPPORTED_BACKENDS:
        return [f"{name}: refit does not install experts for vLLM's {backend} MoE backend"]
    config = module.moe_config
    parallel = config.moe_parallel_config
    ep = layout.expert_parallel and layout.tp_size > 1
    expected = (
        (1, 0, layout.tp_size, layout.tp_rank)
        if ep
        else (
            layout.tp_size,
            layout.tp_rank,
            1,
            0,
        )
    )
    got = (parallel.tp_size, parallel.tp_rank, parallel.ep_size, parallel.ep_rank)
    problems = []
    if got != expected:
        problems.append(f"{name}: experts at (TP, TP rank, EP, EP rank) {got}, expected {expected}")
    if parallel.enable_eplb or module.global_num_experts != config.num_experts:
        problems.append(f"{name}: refit does not install redundant experts (EPLB)")
    if ep and getattr(module, "expert_placement_strategy", "linear") != "linear":
        problems.append(
            f"{name}: experts placed {module.expert_placement_strategy!r}, refit installs "
            "vLLM's linear placement"
        )
    if getattr(config, "has_bias", False):
        problems.append(f"{name}: refit installs experts without biases")
    padded = (config.hidden_dim, config.intermediate_size_per_partition)
    unpadded = (config.hidden_dim_unpadded, config.intermediate_size_per_partition_unpadded)
    if padded != unpadded:
        problems.append(
            f"{name}: vLLM pads its experts (hidden, width) {unpadded} to {padded} at creation"
        )
    plain = (tuple(module.w13_weight.shape), tuple(module.w2_weight.shape))
    if module.local_num_experts != layer.w13_shape[0]:
        problems.append(
            f"{name}: holds {module.local_num_experts} experts, expected {layer.w13_shape[0]}"
        )
    elif config.intermediate_size_per_partition != layer.w2_shape[2]:
        problems.append(
            f"{name}: expert width {config.intermediate_size_per_partition} per worker, "
            f"expected {layer.w2_shape[2]} (tensors {plain})"
        )
    return problems


def _processed(
    module: Any, w13: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`w13` and `w2` (vLLM's plain layout) as the engine computes with them: the processing
    of a first load, run on `module` with them swapped in for its own parameters, which it
    gets back (untouched) before this returns."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
        convert_to_unquantized_kernel_format,
    )
    from vllm.model_executor.utils import replace_parameter

    method = module.quant_method
    live = (module.w13_weight, module.w2_weight)
    try:
        module.w13_weight = torch.nn.Parameter(w13, requires_grad=False)
        module.w2_weight = torch.nn.Parameter(w2, requires_grad=False)
        kernel13, kernel2 = convert_to_unquantized_kernel_format(
            method.unquantized_backend,
            moe_config=module.moe_config,
            w13_weight=module.w13_weight,
            w2_weight=module.w2_weight,
            layer=module,
        )
        replace_parameter(module, "w13_weight", kernel13)
        replace_parameter(module, "w2_weight", kernel2)
        method.moe_kernel.fused_experts.process_weights_after_loading(module)
        return module.w13_weight.data, module.w2_weight.data
    finally:
        module.w13_weight, module.w2_weight = live


_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)


class _ExpertsNotReloaded(logging.Filter):
    """Drops vLLM's reload warnings that the expert layers got no weights (refit installs
    those itself after the reload); keeps every other."""

    def __init__(self, modules: frozenset[str]) -> None:
        super().__init__()
        self._modules = modules
        """Class names of the expert modules."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if record.msg == "%s: Failed to load weights" and args:
            return args[0] not in self._modules
        if str(record.msg).startswith("Following weights were not loaded") and args:
            names = args[0] if isinstance(args[0], set | frozenset | list) else ()
            return not names or not all(
                str(n).endswith((".w13_weight", ".w2_weight")) for n in names
            )
        return True


@contextmanager
def _quiet_about_experts(modules: frozenset[str]) -> Iterator[None]:
    quiet = _ExpertsNotReloaded(modules)
    loggers = [logging.getLogger(name) for name in _RELOAD_LOGGERS]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)
