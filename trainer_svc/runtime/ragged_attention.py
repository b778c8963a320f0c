"""Causal attention of a packed row through cuDNN's ragged-layout SDPA graphs, on Hopper and
newer GPUs.

A packed row's attention on a GPU otherwise runs PyTorch's variable-length flash kernel (FA2),
which on Hopper does a token's attention work much more slowly than the cuDNN dense kernel
that right-padded rows get, enough to keep packing from paying in full (BENCHMARKS.md). cuDNN
runs the same fused attention over a ragged layout: the row's query, key and value stay as
they are ([tokens, heads, dim], any token and head strides), each sequence found by a ragged
offset, masked by its length and causally inside itself. PyTorch reaches that path only
through its private `_cudnn_attention_forward`, which it keeps off below Blackwell (why it is
not used here: BENCHMARKS.md, "Known gaps"). So this module builds the graphs itself,
through cuDNN's frontend (`nvidia-cudnn-frontend`, optional: absent, packed rows keep FA2).

A graph is built once per key and serves every later row of that key: the lengths and
offsets are device tensors, so nothing waits on the host. The key holds buckets, not the
row's own sizes, because RL passes bring new lengths and new counts of sequences every step:
the count rounded up to a power of two (the row's table padded with empty sequences), the
longest sequence rounded up to a power of two (every sequence is masked by its own length, so
a larger bound costs only thread blocks that exit at once), and for the backward's workspace
the row's tokens rounded up to a quarter of their power of two.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

SHORTEST_BOUND = 512
"""The least bound on the longest sequence a graph is built for."""

GRAPHS_KEPT = 64
"""Graphs kept per process (least recently used dropped): each holds its plan and nothing
of a row's size."""

_DTYPES = (torch.bfloat16, torch.float16)

log = logging.getLogger(__name__)


@functools.cache
def _frontend() -> Any:
    """cuDNN's frontend module, or None where it is not installed or cannot load cuDNN."""
    try:
        import cudnn  # type: ignore[import-not-found,import-untyped,unused-ignore]

        cudnn.backend_version()
    except Exception:  # absent, or no usable cuDNN: FA2 serves instead
        return None
    return cudnn


@functools.cache
def _capable(device: int) -> bool:
    return torch.cuda.get_device_capability(device) >= (9, 0)


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why this module cannot serve packed rows of `dtype` on `device` (None: it can)."""
    if device.type != "cuda":
        return "it runs on a GPU only"
    if dtype not in _DTYPES:
        return f"it runs in bfloat16 or float16, and these weights are {dtype}"
    if not _capable(device.index or 0):
        name = torch.cuda.get_device_name(device)
        return f"it needs a Hopper or newer GPU, and this one is {name}"
    if _frontend() is None:
        return "cuDNN's frontend (nvidia-cudnn-frontend) is not installed or finds no cuDNN"
    return None


def applies(query: torch.Tensor, dropout: float) -> bool:
    """Whether this module serves a packed row's attention for `query` ([tokens, heads, dim]):
    where it can run (`unavailable`), with no dropout and a head size cuDNN takes."""
    return not dropout and query.shape[-1] % 8 == 0 and _runs(query.device, query.dtype)


@functools.cache
def _runs(device: torch.device, dtype: torch.dtype) -> bool:
    return unavailable(device, dtype) is None


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    longest: int,
    scale: float,
) -> torch.Tensor | None:
    """Causal attention inside each sequence of a packed row: `query` [tokens, heads, dim],
    `key` and `value` [tokens, groups, dim] (grouped-query attention as is), `cu_seqlens` the
    int32 prefix sums of the lengths with a leading 0 on the row's device, `longest` the
    longest length. Returns [tokens, heads, dim], contiguous; or None where cuDNN cannot build
    this row's graphs (logged once per key), so that the caller runs another kernel. Both
    graphs, the backward's too, are had before anything runs: a graph that cannot be built
    never stops a pass half-way, where other ranks would wait for this one."""
    query, key, value = (_last_dim_dense(x) for x in (query, key, value))
    tokens = query.shape[0]
    if tokens * max(query.stride(0), key.stride(0), value.stride(0)) >= 2**31:
        raise ValueError(f"a packed row of {tokens} tokens is too long for int32 offsets")
    training = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
    forward, backward = _shapes(
        query, key, value, cu_seqlens=cu_seqlens, longest=longest, scale=scale, training=training
    )
    first = _graph(forward)
    second = None if first is None or backward is None else _graph(backward)
    if first is None or (backward is not None and second is None):
        return None
    out = _Ragged.apply(query, key, value, cu_seqlens, (first, second))
    assert isinstance(out, torch.Tensor)
    return out


@dataclass(frozen=True)
class _Shape:
    """What a graph is built for. Strides are in elements: (token, head) per tensor."""

    sequences: int
    longest: int
    heads: int
    groups: int
    dim: int
    dtype: torch.dtype
    scale: float
    strides: tuple[tuple[int, int], ...]  # query, key, value (and for the backward: out, grad)
    tokens: int  # backward only: the workspace's bound; 0 in a forward's key
    device: int
    backward: bool
    stats: bool  # forward only: keeps the softmax statistics for a backward
    deterministic: bool


def _strides(tensor: torch.Tensor) -> tuple[int, int]:
    return (tensor.stride(0), tensor.stride(1))


def _power_of_two(value: int) -> int:
    """The least power of two >= value (>= 1)."""
    return 1 << max(value - 1, 0).bit_length()


def _quarter_octave(value: int) -> int:
    """`value` rounded up to a multiple of a quarter of the power of two below it."""
    step = max(1, (1 << (max(value, 1).bit_length() - 1)) // 4)
    return -(-value // step) * step


def _shapes(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    longest: int,
    scale: float,
    training: bool,
) -> tuple[_Shape, _Shape | None]:
    """The forward's key and, for a pass that trains, the backward's: its gradient comes
    contiguous (`_Ragged.backward` makes it so), as the output is."""
    tokens, heads, dim = query.shape
    forward = _Shape(
        sequences=_power_of_two(cu_seqlens.numel() - 1),
        longest=_power_of_two(max(longest, SHORTEST_BOUND)),
        heads=heads,
        groups=key.shape[1],
        dim=dim,
        dtype=query.dtype,
        scale=float(scale),
        strides=(_strides(query), _strides(key), _strides(value)),
        tokens=0,
        device=query.device.index or 0,
        backward=False,
        stats=training,
        deterministic=False,
    )
    if not training:
        return forward, None
    dense = (heads * dim, dim)
    backward = dataclasses.replace(
        forward,
        strides=(*forward.strides, dense, dense),
        tokens=_quarter_octave(tokens),
        backward=True,
        deterministic=torch.are_deterministic_algorithms_enabled(),
    )
    return forward, backward


def _padded_table(cu_seqlens: torch.Tensor, sequences: int) -> torch.Tensor:
    """`cu_seqlens` extended with empty sequences to `sequences` of them, on the device."""
    missing = sequences + 1 - cu_seqlens.numel()
    if missing == 0:
        return cu_seqlens
    return torch.cat([cu_seqlens, cu_seqlens[-1:].expand(missing)])


class _Graph:
    """One built cuDNN graph, its tensors by role, and its workspace size."""

    def __init__(self, shape: _Shape) -> None:
        cudnn = _frontend()
        self.shape = shape
        self.handle = _handle(shape.device)
        io = cudnn.data_type.BFLOAT16 if shape.dtype is torch.bfloat16 else cudnn.data_type.HALF
        graph = cudnn.pygraph(
            io_data_type=io,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
            handle=self.handle,
        )
        b, s, d = shape.sequences, shape.longest, shape.dim
        self.tensors: dict[str, Any] = {}

        def scalar_table(name: str, rows: int) -> Any:
            made = graph.tensor(
                name=name, dim=[rows, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32
            )
            self.tensors[name] = made
            return made

        def ragged(name: str, heads: int, strides: tuple[int, int], output: Any = None) -> Any:
            token, head = strides
            dim, stride = [b, heads, s, d], [s * token, head, token, 1]
            offsets = scalar_table(f"{name}_offsets", b + 1)
            if output is None:
                made = graph.tensor(name=name, dim=dim, stride=stride, data_type=io)
            else:
                made = output.set_output(True).set_dim(dim).set_stride(stride).set_data_type(io)
            made.set_ragged_offset(offsets)
            self.tensors[name] = made
            return made

        lengths = scalar_table("lengths", b)
        h, g = shape.heads, shape.groups
        q = ragged("q", h, shape.strides[0])
        k = ragged("k", g, shape.strides[1])
        v = ragged("v", g, shape.strides[2])
        masks = {
            "attn_scale": shape.scale,
            "use_padding_mask": True,
            "seq_len_q": lengths,
            "seq_len_kv": lengths,
            "use_causal_mask": True,
        }
        stats_dim, stats_stride = [b, h, s, 1], [h * s, s, 1, 1]
        if not shape.backward:
            o, stats = graph.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=shape.stats, **masks)
            ragged("o", h, (h * d, d), output=o)
            if shape.stats:
                stats.set_output(True).set_dim(stats_dim).set_stride(stats_stride)
                stats.set_data_type(cudnn.data_type.FLOAT)
                self.tensors["stats"] = stats
        else:
            o = ragged("o", h, shape.strides[3])
            grad = ragged("do", h, shape.strides[4])
            stats = graph.tensor(
                name="stats", dim=stats_dim, stride=stats_stride, data_type=cudnn.data_type.FLOAT
            )
            self.tensors["stats"] = stats
            dq, dk, dv = graph.sdpa_backward(
                name="sdpa_backward",
                q=q,
                k=k,
                v=v,
                o=o,
                dO=grad,
                stats=stats,
                max_total_seq_len_q=shape.tokens,
                max_total_seq_len_kv=shape.tokens,
                use_deterministic_algorithm=shape.deterministic,
                **masks,
            )
            ragged("dq", h, (h * d, d), output=dq)
            ragged("dk", g, (g * d, d), output=dk)
            ragged("dv", g, (g * d, d), output=dv)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph = graph
        self.workspace = graph.get_workspace_size()

    def run(self, buffers: dict[str, torch.Tensor], device: torch.device) -> None:
        cudnn = _frontend()
        workspace = torch.empty(self.workspace, dtype=torch.uint8, device=device)
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream(device).cuda_stream)
        self.graph.execute(
            {self.tensors[k]: v for k, v in buffers.items()}, workspace, handle=self.handle
        )


@functools.cache
def _handle(device: int) -> Any:
    with torch.cuda.device(device):
        return _frontend().create_handle()


_graphs: OrderedDict[_Shape, _Graph] = OrderedDict()
_lock = threading.Lock()


_unbuildable: set[_Shape] = set()


def _graph(shape: _Shape) -> _Graph | None:
    """The graph of `shape`, built once; None (and a warning, once) where cuDNN cannot build
    it."""
    with _lock:
        found = _graphs.get(shape)
        if found is not None:
            _graphs.move_to_end(shape)
            return found
        if shape in _unbuildable:
            return None
    try:
        built = _Graph(shape)
    except Exception as e:  # cuDNN's refusal of this graph: the caller runs another kernel
        log.warning(
            "cuDNN cannot build the ragged attention graph %s (%s): flash runs it", shape, e
        )
        with _lock:
            _unbuildable.add(shape)
        return None
    with _lock:
        _graphs[shape] = built
        while len(_graphs) > GRAPHS_KEPT:
            _graphs.popitem(last=False)
    return built


def graphs_built() -> int:
    """How many graphs this process holds (for tests and logs)."""
    return len(_graphs)


def _tables(cu_seqlens: torch.Tensor, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The lengths and each tensor's ragged offsets (in elements), as the graph's int32
    [rows, 1, 1, 1] tables, computed on the device."""
    tables = {"lengths": (cu_seqlens[1:] - cu_seqlens[:-1]).view(-1, 1, 1, 1)}
    for name, tensor in tensors.items():
        tables[f"{name}_offsets"] = (cu_seqlens * tensor.stride(0)).view(-1, 1, 1, 1)
    return tables


def _last_dim_dense(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


class _Ragged(torch.autograd.Function):
    @staticmethod
    def forward(  # noqa: PLR0917 (autograd passes inputs positionally)
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seqlens: torch.Tensor,
        graphs: tuple[_Graph, _Graph | None],
    ) -> torch.Tensor:
        graph = graphs[0]
        shape = graph.shape
        tokens, heads, dim = query.shape
        cu_seqlens = _padded_table(cu_seqlens, shape.sequences)
        out = torch.empty(tokens, heads, dim, dtype=query.dtype, device=query.device)
        buffers = {"q": query, "k": key, "v": value, "o": out}
        buffers.update(_tables(cu_seqlens, buffers))
        stats = None
        if shape.stats:
            stats = torch.empty(
                shape.sequences, heads, shape.longest, 1, dtype=torch.float32, device=query.device
            )
            buffers["stats"] = stats
        graph.run(buffers, query.device)
        ctx.save_for_backward(query, key, value, out, stats, cu_seqlens)
        ctx.backward_graph = graphs[1]
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, stats, cu_seqlens = ctx.saved_tensors
        graph: _Graph | None = ctx.backward_graph
        assert graph is not None, "a pass that trains has its backward graph from the forward"
        if grad.stride() != out.stride():  # the backward graph reads it laid out as `out`
            grad = grad.contiguous()
        dq, dk, dv = (
            torch.empty_like(x, memory_format=torch.contiguous_format) for x in (query, key, value)
        )
        buffers = {"q": query, "k": key, "v": value, "o": out, "do": grad, "stats": stats}
        buffers.update(dq=dq, dk=dk, dv=dv)
        tables = _tables(cu_seqlens, {n: t for n, t in buffers.items() if n != "stats"})
        buffers.update(tables)
        graph.run(buffers, query.device)
        return dq, dk, dv, None, None
