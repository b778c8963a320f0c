"""Megatron-core <-> HF names and layouts of a mixture-of-experts layer's router and experts.

Megatron (local spec, `SequentialMLP`) holds a rank's experts as
`mlp.experts.local_experts.{e}.linear_fc{1,2}.weight` with a *local* index e; expert parallel
rank r of EP holds the contiguous global experts `r * E/EP + e`. Transformer Engine's grouped
spec (`TEGroupedMLP`) names the same tensors `mlp.experts.linear_fc{1,2}.weight{e}`. Global
state dicts here (as in `convert`) use the global expert index under the local-spec name.

Each expert is a SwiGLU MLP: fc1 = [gate; up] along dim 0 (the dense `fuse_gate_up` layout;
expert tensor parallelism splits each half on its own, as TP splits dense fc1), fc2 = down.
HF checkpoints store one tensor per expert and projection: Qwen3-MoE as
`mlp.experts.{e}.{gate,up,down}_proj.weight` with the router `mlp.gate.weight` [E, hidden],
Mixtral as `block_sparse_moe.experts.{e}.{w1,w3,w2}.weight` (gate, up, down) with the router
`block_sparse_moe.gate.weight` (`HF_EXPERT_NAMES`).
transformers 5 fuses the experts into 3-D tensors in memory only: its own loading converts,
so checkpoints on disk keep per-expert names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megatron_hf.spec import ModelFamily, ModelSpec

ROUTER = "mlp.router.weight"


@dataclass(frozen=True)
class HFExpertNames:
    """How a family's HF checkpoint names a layer's router and experts."""

    router: str
    experts: str
    """Prefix of the per-expert tensors, followed by `.{e}.{projection}.weight`."""
    gate: str
    up: str
    down: str


QWEN3_MOE_NAMES = HFExpertNames(
    router="mlp.gate.weight",
    experts="mlp.experts",
    gate="gate_proj",
    up="up_proj",
    down="down_proj",
)
MIXTRAL_NAMES = HFExpertNames(
    router="block_sparse_moe.gate.weight",
    experts="block_sparse_moe.experts",
    gate="w1",
    up="w3",
    down="w2",
)
HF_EXPERT_NAMES: dict[ModelFamily, HFExpertNames] = {
    ModelFamily.QWEN3_MOE: QWEN3_MOE_NAMES,
    ModelFamily.MIXTRAL: MIXTRAL_NAMES,
}


def hf_expert_names(family: ModelFamily | None) -> HFExpertNames:
    """A family's names; Qwen3-MoE's where the family is not known (or dense)."""
    return HF_EXPERT_NAMES.get(family, QWEN3_MOE_NAMES) if family else QWEN3_MOE_NAMES


_LOCAL_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")
_GROUPED_RE = re.compile(r"^mlp\.experts\.linear_fc([12])\.weight(\d+)$")
_ANY_PREFIX_RE = re.compile(r"(?:^|\.)mlp\.experts\..+$")


@dataclass(frozen=True)
class ExpertParam:
    """One expert tensor of a layer: which expert (local or global, as the name says) and
    whether it is fc1 ([gate; up]) or fc2 (down)."""

    expert: int
    fc: int

    @property
    def suffix(self) -> str:
        """The local-spec layer suffix (under `decoder.layers.{i}.`)."""
        return f"mlp.experts.local_experts.{self.expert}.linear_fc{self.fc}.weight"


def parse_expert_suffix(suffix: str) -> ExpertParam | None:
    """A layer suffix of an expert tensor (local or grouped spec) -> its expert and fc."""
    match = _LOCAL_RE.match(suffix)
    if match:
        return ExpertParam(expert=int(match[1]), fc=int(match[2]))
    match = _GROUPED_RE.match(suffix)
    if match:
        return ExpertParam(expert=int(match[2]), fc=int(match[1]))
    return None


def is_expert_name(megatron_name: str) -> bool:
    """Whether a Megatron parameter name (any prefix) is an expert tensor: those are split over
    the expert-parallel grid (EP x ETP), not over TP."""
    match = _ANY_PREFIX_RE.search(megatron_name)
    return match is not None and parse_expert_suffix(match[0].lstrip(".")) is not None


def moe_layer_suffixes(spec: ModelSpec) -> list[str]:
    """The MLP suffixes of an expert layer, global expert ids, in GPTModel's parameter order."""
    assert spec.moe is not None
    names = [ROUTER]
    for e in range(spec.moe.num_experts):
        names += [ExpertParam(e, 1).suffix, ExpertParam(e, 2).suffix]
    return names


def hf_suffixes_of(suffix: str, family: ModelFamily | None = None) -> tuple[str, ...] | None:
    """HF layer suffixes of a Megatron MLP suffix of an expert layer (local-spec or grouped
    name, global expert ids) in `family`'s naming; None when it is not one."""
    names = hf_expert_names(family)
    if suffix == ROUTER:
        return (names.router,)
    param = parse_expert_suffix(suffix)
    if param is None:
        return None
    prefix = f"{names.experts}.{param.expert}."
    if param.fc == 1:
        return (f"{prefix}{names.gate}.weight", f"{prefix}{names.up}.weight")
    return (f"{prefix}{names.down}.weight",)


def canonical_suffix(suffix: str) -> str:
    """The local-spec suffix of an expert tensor given under its grouped (TE) name."""
    param = parse_expert_suffix(suffix)
    return param.suffix if param is not None else suffix


def hf_expert_shape(hf_suffix: str, spec: ModelSpec) -> tuple[int, ...] | None:
    """Shape of an HF layer tensor of an expert layer (router or expert); None otherwise."""
    if spec.moe is None:
        return None
    names = hf_expert_names(spec.family)
    hidden, width = spec.hidden_size, spec.moe.ffn_hidden_size
    if hf_suffix == names.router:
        return (spec.moe.num_experts, hidden)
    projections = "|".join(re.escape(p) for p in (names.gate, names.up, names.down))
    match = re.fullmatch(rf"{re.escape(names.experts)}\.(\d+)\.({projections})\.weight", hf_suffix)
    if match is None or int(match[1]) >= spec.moe.num_experts:
        return None
    tail = match[2]
    return (hidden, width) if tail == names.down else (width, hidden)


def experts_per_rank(num_experts: int, expert_parallel: int) -> int:
    if expert_parallel < 1 or num_experts % expert_parallel:
        raise ValueError(
            f"{num_experts} experts do not split over expert parallel {expert_parallel}"
        )
    return num_experts // expert_parallel


def global_expert(local: int, *, ep_rank: int, num_experts: int, expert_parallel: int) -> int:
    """Megatron's contiguous placement: EP rank r holds experts [r*E/EP, (r+1)*E/EP)."""
    per_rank = experts_per_rank(num_experts, expert_parallel)
    if not 0 <= local < per_rank or not 0 <= ep_rank < expert_parallel:
        raise ValueError(
            f"local expert {local} of EP rank {ep_rank} out of range for {num_experts} experts "
            f"over expert parallel {expert_parallel}"
        )
    return ep_rank * per_rank + local


def expert_owner(global_id: int, *, num_experts: int, expert_parallel: int) -> tuple[int, int]:
    """(EP rank, local index) holding global expert `global_id`."""
    per_rank = experts_per_rank(num_experts, expert_parallel)
    if not 0 <= global_id < num_experts:
        raise ValueError(f"expert {global_id} out of range for {num_experts} experts")
    return divmod(global_id, per_rank)


def with_expert(suffix: str, expert: int) -> str:
    """An expert suffix with its expert index replaced (local <-> global), local-spec named."""
    param = parse_expert_suffix(suffix)
    if param is None:
        raise ValueError(f"{suffix!r} is not an expert tensor")
    return ExpertParam(expert, param.fc).suffix


_LOCAL_INDEX_RE = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)(\.)")


def globalize_expert_name(
    name: str, *, ep_rank: int, num_experts: int, expert_parallel: int
) -> str:
    """A rank's local-spec parameter name with its local expert index made global (other
    names unchanged)."""
    match = _LOCAL_INDEX_RE.search(name)
    if match is None:
        return name
    expert = global_expert(
        int(match[2]), ep_rank=ep_rank, num_experts=num_experts, expert_parallel=expert_parallel
    )
    return f"{name[: match.start()]}{match[1]}{expert}{match[3]}{name[match.end() :]}"


_GROUPED_NAME_RE = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.linear_fc([12])\.weight$")


def grouped_expert_name(layer: int, fc: int) -> str:
    """The published name of layer `layer`'s experts' fc1 or fc2, every expert in one tensor
    (`grouped_expert_shape`): a refit plans and reads a layer's experts as a few boxes of one
    tensor instead of one tensor per expert."""
    if fc not in (1, 2) or layer < 0:
        raise ValueError(f"no grouped expert tensor for layer {layer}, fc {fc}")
    return f"decoder.layers.{layer}.mlp.experts.linear_fc{fc}.weight"


def parse_grouped_expert_name(name: str) -> tuple[int, int] | None:
    """(layer, fc) of a grouped expert tensor's name; None for any other name."""
    match = _GROUPED_NAME_RE.match(name)
    return (int(match[1]), int(match[2])) if match else None


def grouped_expert_shape(spec: ModelSpec, fc: int) -> tuple[int, int, int]:
    """Global shape of a layer's grouped experts: fc1 [E, 2I, H] (each expert's [gate; up]),
    fc2 [E, H, I]."""
    if spec.moe is None:
        raise ValueError(f"{spec.architecture} has no experts")
    experts, width, hidden = spec.moe.num_experts, spec.moe.ffn_hidden_size, spec.hidden_size
    if fc == 1:
        return (experts, 2 * width, hidden)
    if fc == 2:
        return (experts, hidden, width)
    raise ValueError(f"experts have fc1 and fc2, not fc{fc}")


_LAYER_OF_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def expert_group_of(name: str) -> tuple[str, int] | None:
    """(grouped name, global expert) of a global local-spec expert parameter name; None for
    any other name."""
    match = _LAYER_OF_RE.match(name)
    if match is None:
        return None
    param = parse_expert_suffix(match[2])
    if param is None:
        return None
    return grouped_expert_name(int(match[1]), param.fc), param.expert
