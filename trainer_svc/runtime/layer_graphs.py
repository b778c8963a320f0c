"""CUDA graphs of the transformer layers, for passes the GPU finishes faster than the host
launches them (`--cuda-graphs layers`).

A small training pass (a light RL step: one or a few short sequences) is host-bound: each
layer's forward and backward launch on the order of a hundred kernels through megatron's
Python, and the GPU waits for the host. Here each eligible pass shape gets one forward and one
backward CUDA graph per layer, captured the first time the shape is seen; later passes of that
shape replay them, two launches per layer and pass plus the copies of its inputs.

- **Eligible**: a training pass (gradients on, the layer in training mode) of right-padded rows
  on CUDA: no packed document bounds, attention mask or bias, at most `GraphLimits.max_tokens`
  tokens. Everything else (Forward, packed rows, longer passes) runs eagerly, unchanged, and so
  does a shape beyond `GraphLimits.max_shapes`: each kept shape holds its layers' inputs and
  outputs for as long as the process lives.
- **One memory pool, replayed in capture order.** A shape's graphs are captured in the order a
  pass runs them (forwards first to last, backwards last to first), so a backward graph may
  reuse memory only a later layer's backward has finished with, which is also the order every
  pass replays them in. Every shape's graphs share the pool: passes run one at a time, so the
  memory one shape's pass keeps between its forward and its backward is never needed while
  another shape's graphs run, and the pool holds the largest shape's pass, not their sum. A
  pass that stops early (an error) leaves nothing behind that the next replay of the forwards
  does not rewrite.
- **Gradients** go where megatron's DDP would put them: where every parameter has a `main_grad`
  (megatron's DDP without overlapped reduction, as the trainer builds it), the backward graph
  adds each weight's gradient into it, as DDP's hook would after the gradient accumulator, so a
  shape keeps no gradient buffers of its own (DDP's per-parameter hooks still run, and find no
  gradient to add).
  Otherwise they leave the graph as the outputs of an autograd function and reach each
  parameter through its usual gradient accumulator.
- **Capture** runs on a side stream in CUDA's thread-local capture mode, so the publication's
  threads may use the GPU meanwhile, after eager warm-up passes on the same stream (cuDNN and
  cuBLAS choose and allocate outside the capture). A capture that fails is logged and its shape
  runs eagerly from then on.
- **Layouts** whose layer passes have no host synchronization and no collectives: one tensor-
  and pipeline-parallel rank, dense MLPs, no activation recompute (`refusal` says why not,
  at start).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

_NONE_ARGUMENTS = frozenset(
    {
        "attention_mask",
        "context",
        "context_mask",
        "attention_bias",
        "inference_context",
        "inference_params",
        "packed_seq_params",
        "sequence_len_offset",
        "padding_mask",
        "rotary_pos_cos",
        "rotary_pos_sin",
        "rotary_pos_cos_sin",
    }
)
"""Layer arguments a graphed pass must leave unset: each changes what the layer computes in a
way a captured graph cannot follow (masks, packed rows, inference caches)."""


@dataclass(frozen=True, kw_only=True)
class GraphLimits:
    max_tokens: int = 4096
    """The longest pass (rows times tokens) that is graphed; longer ones are not host-bound."""
    max_shapes: int = 4
    """How many pass shapes keep graphs (each its layers' inputs and outputs; the shared pool
    the largest pass's activations)."""
    warmup_passes: int = 2
    """Eager forward and backward passes on the capture stream before a shape's capture."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.max_shapes < 1 or self.warmup_passes < 1:
            raise ValueError(f"every graph limit must be >= 1, got {self}")


def refusal(*, on_gpu: bool, tensor_parallel: int, pipeline_parallel: int, moe: bool) -> str | None:
    """Why `--cuda-graphs layers` cannot run in this layout, or None (with activation
    recompute `ModelConfig` refuses it already)."""
    reasons = []
    if not on_gpu:
        reasons.append("it needs CUDA ranks")
    if tensor_parallel > 1:
        reasons.append(f"tensor parallelism ({tensor_parallel}) communicates inside a layer")
    if pipeline_parallel > 1:
        reasons.append(
            f"pipeline parallelism ({pipeline_parallel}) keeps several passes of a layer in "
            "flight, each needing its own activations"
        )
    if moe:
        reasons.append("mixture-of-experts layers size their work on the host")
    if not reasons:
        return None
    return "--cuda-graphs layers: " + "; ".join(reasons)


class _LayerGraph:
    """One layer's captured forward and backward for one pass shape, with the static tensors
    they read and write."""

    def __init__(self, call: Callable[..., torch.Tensor], params: tuple[torch.nn.Parameter, ...]):
        self.call = call
        self.params = params
        self.hidden = torch.empty(0)
        self.rotary = torch.empty(0)
        self.out = torch.empty(0)
        self.grad_out = torch.empty(0)
        self.grads: tuple[torch.Tensor | None, ...] = ()
        """The input's gradient, then each parameter's (none where they go to `main_grad`)."""
        self.forward_graph = torch.cuda.CUDAGraph()
        self.backward_graph = torch.cuda.CUDAGraph()


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, graph: _LayerGraph, hidden: torch.Tensor, rotary: torch.Tensor, *params: Any
    ) -> torch.Tensor:
        graph.hidden.copy_(hidden)
        graph.rotary.copy_(rotary)
        graph.forward_graph.replay()
        ctx.graph = graph
        return graph.out.detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        graph: _LayerGraph = ctx.graph
        graph.grad_out.copy_(grad)
        graph.backward_graph.replay()
        hidden_grad, *param_grads = (g.detach() if g is not None else None for g in graph.grads)
        if not param_grads:  # added to the parameters' main_grad inside the graph
            param_grads = [None] * len(graph.params)
        else:
            # Copies: autograd may keep a returned tensor as `param.grad` itself, and the next
            # replay rewrites the graph's buffer (a second pass would add it to itself).
            param_grads = [None if g is None else g.clone() for g in param_grads]
        return (None, hidden_grad, None, *param_grads)


def _layer_call(eager: Callable[..., Any]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def call(hidden: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
        out = eager(hidden_states=hidden, attention_mask=None, rotary_pos_emb=rotary)
        if isinstance(out, tuple):
            if any(extra is not None for extra in out[1:]):
                raise RuntimeError("a graphed layer returned more than its hidden states")
            out = out[0]
        return out

    return call


class LayerGraphs:
    """Replaces the `forward` of each of `layers` (one pipeline stage's, in pass order) with a
    dispatcher that replays that layer's graphs for an eligible pass and runs the layer's own
    forward otherwise."""

    def __init__(self, layers: Sequence[torch.nn.Module], limits: GraphLimits) -> None:
        self.limits = limits
        self.layers = list(layers)
        self._calls = []
        self._params = []
        for index, layer in enumerate(self.layers):
            eager = layer.forward
            self._calls.append(_layer_call(eager))
            self._params.append(tuple(_trainable(layer)))
            layer.forward = functools.partial(self._forward, index, eager)
        self.main_grads = all(
            isinstance(getattr(p, "main_grad", None), torch.Tensor)
            for params in self._params
            for p in params
        )
        """Whether the backward graphs add into the parameters' `main_grad` (module docs)."""
        self._pool: Any = None
        self._shapes: dict[tuple[Any, ...], list[_LayerGraph] | None] = {}
        """Captured graphs by pass shape; None for a shape whose capture failed."""
        self.captures = 0
        self.replays = 0

    def _forward(self, index: int, eager: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        graphs = self._graphs(index, args, kwargs)
        if graphs is None:
            return eager(*args, **kwargs)
        graph = graphs[index]
        if index == 0:
            self.replays += 1
        out = _Replay.apply(graph, kwargs["hidden_states"], kwargs["rotary_pos_emb"], *graph.params)
        return out, None

    def _graphs(
        self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[_LayerGraph] | None:
        hidden = kwargs.get("hidden_states")
        rotary = kwargs.get("rotary_pos_emb")
        if (
            args
            or not isinstance(hidden, torch.Tensor)
            or not isinstance(rotary, torch.Tensor)
            or not hidden.is_cuda
            or not torch.is_grad_enabled()
            or not self.layers[index].training
            or any(kwargs.get(name) is not None for name in _NONE_ARGUMENTS)
            or set(kwargs) - _NONE_ARGUMENTS - {"hidden_states", "rotary_pos_emb"}
            or hidden.shape[0] * hidden.shape[1] > self.limits.max_tokens
        ):
            return None
        key = (tuple(hidden.shape), hidden.dtype, tuple(rotary.shape), rotary.dtype)
        if key in self._shapes:
            return self._shapes[key]
        # Only the first layer captures: a pass whose first layer ran eagerly stays eager.
        if index != 0 or len(self._shapes) >= self.limits.max_shapes:
            return None
        try:
            graphs = self._capture(hidden, rotary)
        except Exception:
            log.warning(
                "CUDA graphs of the layers for passes of shape %s could not be captured; "
                "such passes run eagerly",
                tuple(hidden.shape),
                exc_info=True,
            )
            graphs = None
        self._shapes[key] = graphs
        return graphs

    def _capture(self, hidden: torch.Tensor, rotary: torch.Tensor) -> list[_LayerGraph]:
        graphs = [_LayerGraph(c, p) for c, p in zip(self._calls, self._params, strict=True)]
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        pool = self._pool
        stream = torch.cuda.Stream(device=hidden.device)
        stream.wait_stream(torch.cuda.current_stream(hidden.device))
        with torch.cuda.stream(stream), _stand_ins(self.layers) as stand_ins:
            for graph, params in zip(graphs, stand_ins, strict=True):
                graph.params = params
            for graph in graphs:
                graph.hidden = torch.randn_like(hidden).requires_grad_()
                graph.rotary = rotary.detach().clone()
            for _ in range(self.limits.warmup_passes):
                for graph in graphs:
                    out = graph.call(graph.hidden, graph.rotary)
                    torch.autograd.grad(
                        out, (graph.hidden, *graph.params), torch.ones_like(out), allow_unused=True
                    )
                    del out
            stream.synchronize()
            for graph in graphs:
                graph.forward_graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    graph.out = graph.call(graph.hidden, graph.rotary)
                finally:
                    graph.forward_graph.capture_end()
            for graph in reversed(graphs):
                graph.grad_out = torch.empty_like(graph.out)
                graph.backward_graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    grads = torch.autograd.grad(
                        graph.out,
                        (graph.hidden, *graph.params),
                        graph.grad_out,
                        allow_unused=True,
                    )
                    if self.main_grads:
                        for param, grad in zip(graph.params, grads[1:], strict=True):
                            if grad is not None:
                                param.main_grad.add_(grad)  # type: ignore[attr-defined]
                        grads = grads[:1]  # the rest were the pool's temporaries
                    graph.grads = grads
                    del grads
                finally:
                    graph.backward_graph.capture_end()
        torch.cuda.current_stream(hidden.device).wait_stream(stream)
        for graph, params in zip(graphs, self._params, strict=True):
            graph.params = params
        self.captures += 1
        log.info(
            "captured CUDA graphs of %d layers for passes of shape %s",
            len(graphs),
            tuple(hidden.shape),
        )
        return graphs


def _trainable(layer: torch.nn.Module) -> list[torch.nn.Parameter]:
    """`layer`'s parameters that take gradients, each once, in `parameters()` order."""
    return [p for p in layer.parameters() if p.requires_grad]


@contextlib.contextmanager
def _stand_ins(
    layers: Sequence[torch.nn.Module],
) -> Iterator[list[tuple[torch.nn.Parameter, ...]]]:
    """While capturing, each trainable parameter of `layers` is replaced by a new parameter on
    the same storage (and with its attributes), so the graphs read and write the parameters'
    memory but differentiate with respect to leaves of their own: the parameters' gradient
    accumulators, created on the default stream and kept by megatron's DDP, would make the
    capture stream depend on the legacy stream, which CUDA refuses during a capture."""
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    per_layer: list[tuple[torch.nn.Parameter, ...]] = []
    try:
        for layer in layers:
            made: dict[int, torch.nn.Parameter] = {}
            for param in _trainable(layer):
                made[id(param)] = torch.nn.Parameter(param.detach(), requires_grad=True)
                made[id(param)].__dict__.update(param.__dict__)
            for module in layer.modules():
                for name, held in list(module._parameters.items()):
                    if held is not None and id(held) in made:
                        module._parameters[name] = made[id(held)]
                        swapped.append((module, name, held))
            per_layer.append(tuple(made.values()))
        yield per_layer
    finally:
        for module, name, param in reversed(swapped):
            module._parameters[name] = param


def install(layers: Sequence[torch.nn.Module], limits: GraphLimits | None = None) -> LayerGraphs:
    """Graphs `layers` (see the module docs); returns the dispatcher, which counts captures
    and replays."""
    return LayerGraphs(layers, limits or GraphLimits())
