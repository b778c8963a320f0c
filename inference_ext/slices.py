"""Which part of each full HF tensor a vLLM tensor-parallel worker keeps.

vLLM's weight loaders take full HF tensors and each narrows to its own TP rank; a receiver that
knows the narrow in advance pulls only that part. The rules below are vLLM's (0.32) for the
Llama/Qwen2/Qwen3 layers: column-parallel rows split evenly, query heads split and key/value
heads split or, when there are fewer KV heads than ranks, replicated (rank r reads head
r // (T / kv_heads)); row-parallel columns split evenly; vocabulary rows split over the vocab
padded to a multiple of 64 (so the last ranks may hold fewer real rows, or none); norms whole.
A mixture-of-experts layer's experts split one of two ways (`expert_share`): under TP alone
each worker holds every expert and an even part of each one's width; with vLLM's expert
parallelism (`--enable-expert-parallel`, EP size = TP size) whole experts, EP rank r the
contiguous r-th share of them (vLLM's linear placement). The router is replicated.
`RefitWorkerExtension` checks these against the running engine's own layers at `refit_init`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatron_hf.convert import hf_shape
from megatron_hf.spec import ModelSpec
from refit_sidecar.core.manifest import Box

VLLM_VOCAB_PADDING = 64


@dataclass(frozen=True)
class ReceiverLayout:
    """The vLLM worker's place in its engine: tensor-parallel rank `tp_rank` of `tp_size`;
    `expert_parallel`: the engine deals whole experts out over its TP ranks instead of
    splitting each one (vLLM's `enable_expert_parallel`)."""

    tp_rank: int = 0
    tp_size: int = 1
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} out of range for tp_size {self.tp_size}")


class UnsupportedLayout(ValueError):
    """The model cannot be split over this many vLLM ranks."""


def vocab_rows(spec: ModelSpec, layout: ReceiverLayout) -> tuple[int, int]:
    """[start, stop) of the real vocabulary rows this rank's embedding / LM head holds."""
    padded = -(-spec.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    if padded % layout.tp_size:
        raise UnsupportedLayout(
            f"vocabulary {spec.vocab_size} (padded to {padded}) does not split over "
            f"{layout.tp_size} ranks"
        )
    per_rank = padded // layout.tp_size
    start = min(layout.tp_rank * per_rank, spec.vocab_size)
    return start, min(start + per_rank, spec.vocab_size)


def kv_heads(spec: ModelSpec, layout: ReceiverLayout) -> tuple[int, int]:
    """[first, last) key/value head this rank holds (one replicated head when kv < TP)."""
    kv, tp = spec.num_query_groups, layout.tp_size
    if kv >= tp:
        if kv % tp:
            raise UnsupportedLayout(f"{kv} key/value heads do not split over {tp} ranks")
        per_rank = kv // tp
        return layout.tp_rank * per_rank, (layout.tp_rank + 1) * per_rank
    if tp % kv:
        raise UnsupportedLayout(f"{tp} ranks cannot replicate {kv} key/value heads evenly")
    head = layout.tp_rank // (tp // kv)
    return head, head + 1


def _even(total: int, layout: ReceiverLayout, what: str) -> tuple[int, int]:
    if total % layout.tp_size:
        raise UnsupportedLayout(f"{what} ({total}) does not split over {layout.tp_size} ranks")
    per_rank = total // layout.tp_size
    return layout.tp_rank * per_rank, (layout.tp_rank + 1) * per_rank


@dataclass(frozen=True)
class ExpertShare:
    """The part of every expert layer a worker holds: global experts [first, stop) of
    `experts`, and [first, stop) of each one's width (its intermediate size)."""

    experts: tuple[int, int]
    width: tuple[int, int]

    @property
    def num_experts(self) -> int:
        return self.experts[1] - self.experts[0]

    @property
    def width_size(self) -> int:
        return self.width[1] - self.width[0]


def expert_share(spec: ModelSpec, layout: ReceiverLayout) -> ExpertShare:
    """The experts and expert width this worker holds (see the module's docstring)."""
    if spec.moe is None:
        raise ValueError(f"{spec.architecture} has no experts")
    experts, width = spec.moe.num_experts, spec.moe.ffn_hidden_size
    if layout.expert_parallel and layout.tp_size > 1:
        if experts % layout.tp_size:
            raise UnsupportedLayout(
                f"{experts} experts do not split over expert parallel {layout.tp_size} "
                f"(vLLM's EP size is its TP size, {layout.tp_size})"
            )
        return ExpertShare(_even(experts, layout, "experts"), (0, width))
    if width % layout.tp_size:
        raise UnsupportedLayout(
            f"the expert width ({width}) does not split over {layout.tp_size} ranks"
        )
    return ExpertShare((0, experts), _even(width, layout, "expert width"))


def receiver_layout_problems(
    spec: ModelSpec, tp_size: int, *, expert_parallel: bool = False
) -> list[str]:
    """Every reason a vLLM engine at TP=`tp_size` (dealing whole experts out when
    `expert_parallel`) cannot hold `spec` by the rules above (the same functions `hf_slice`
    and `expert_share` use), each naming its numbers; empty when it can."""
    layout = ReceiverLayout(0, tp_size, expert_parallel)
    mlp: Callable[[], object] = (
        (lambda: _even(spec.ffn_hidden_size, layout, "ffn_hidden_size"))
        if spec.moe is None
        else (lambda: expert_share(spec, layout))
    )
    checks = (
        lambda: _even(spec.num_attention_heads, layout, "attention heads"),
        lambda: kv_heads(spec, layout),
        mlp,
        lambda: vocab_rows(spec, layout),
    )
    problems = []
    for check in checks:
        try:
            check()
        except UnsupportedLayout as e:
            problems.append(str(e))
    return problems


def check_receiver_layout(spec: ModelSpec, layout: ReceiverLayout) -> None:
    """Raise `UnsupportedLayout` listing every problem of `receiver_layout_problems`."""
    problems = receiver_layout_problems(
        spec, layout.tp_size, expert_parallel=layout.expert_parallel
    )
    if problems:
        experts = " with expert parallelism" if layout.expert_parallel else ""
        raise UnsupportedLayout(
            f"the model cannot be refit into an engine at TP={layout.tp_size}{experts}: "
            + "; ".join(problems)
        )


def hf_slice(hf_name: str, spec: ModelSpec, layout: ReceiverLayout) -> Box | None:
    """The box of HF tensor `hf_name` that this rank's loader keeps; None when it keeps
    nothing (a vocabulary shard made only of padding)."""
    shape = hf_shape(hf_name, spec)
    full = Box.full(shape)
    key = hf_name.rsplit(".", 2)[-2]
    if layout.tp_size == 1:
        return full
    d = spec.head_dim
    rows: tuple[int, int] | None = None
    cols: tuple[int, int] | None = None
    if key in ("embed_tokens", "lm_head"):
        rows = vocab_rows(spec, layout)
        if rows[0] == rows[1]:
            return None
    elif key == "q_proj":
        first, last = _even(spec.num_attention_heads, layout, "attention heads")
        rows = first * d, last * d
    elif key in ("k_proj", "v_proj"):
        first, last = kv_heads(spec, layout)
        rows = first * d, last * d
    elif key in ("gate_proj", "up_proj"):
        rows = _even(spec.ffn_hidden_size, layout, "ffn_hidden_size")
    elif key == "o_proj":
        first, last = _even(spec.num_attention_heads, layout, "attention heads")
        cols = first * d, last * d
    elif key == "down_proj":
        cols = _even(spec.ffn_hidden_size, layout, "ffn_hidden_size")
    else:
        return full
    ranges = list(full.ranges)
    if rows is not None:
        ranges[0] = rows
    if cols is not None:
        ranges[1] = cols
    return Box(tuple(ranges))
