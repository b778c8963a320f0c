"""A vLLM receiver's plan of a mixture-of-experts model over a manifest published as the
trainer publishes grouped experts (each expert-parallel rank its experts' boxes of one
linear_fc1 [E, 2I, H] and one linear_fc2 [E, H, I] per layer): which boxes each worker reads
at TP=1, TP=2 and TP=2 with expert parallelism, and a pull through the in-memory transport
that assembles vLLM's fused w13/w2 from the HF checkpoint's experts bit for bit (as
`fused_experts_of` builds them, the way vLLM's loader narrows each expert). Also that an
expert-parallel worker's share is vLLM's own linear placement, and what a receiver refuses,
naming the numbers."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch

from inference_ext.expert_slices import (
    ExpertTarget,
    FusedExpertTensor,
    parse_target,
    receiver_names,
    target_name,
)
from inference_ext.fused_experts import FusedExperts
from inference_ext.receiver import TORCH_DTYPES
from inference_ext.receiver_plan import HFSlice, ReceiverPlan, plan_receiver
from inference_ext.refit_options import RefitError
from inference_ext.slices import (
    ReceiverLayout,
    UnsupportedLayout,
    check_receiver_layout,
    expert_share,
    receiver_layout_problems,
)
from megatron_hf.checkpoint import load_hf_state_dict
from megatron_hf.convert import hf_names, hf_to_megatron
from megatron_hf.experts import (
    grouped_expert_name,
    hf_expert_names,
    parse_expert_suffix,
    parse_grouped_expert_name,
)
from megatron_hf.spec import ModelFamily, ModelSpec, MoESpec, padded_vocab_size
from megatron_hf.tiny import write_tiny_checkpoint
from refit_sidecar.core.manifest import (
    AgentRecord,
    Box,
    DType,
    Manifest,
    ParameterRecord,
    ShardLocation,
    ShardRecord,
)
from refit_sidecar.core.plan import PullPlan
from refit_sidecar.integrity.checksum import checksum
from refit_sidecar.memory.region import Region
from refit_sidecar.publish.shard_specs import (
    ShardSpec,
    expert_group_spec,
    megatron_shard_spec,
)
from refit_sidecar.pull.transport import InMemoryTransport
from tests.refit.shards import shard_of
from tests.support.fidelity import fused_experts_of
from tests.support.specs import synthetic_spec

EXPERTS, WIDTH, HIDDEN = 8, 32, 64
ALIGNMENT = 256
LAYOUTS = {
    "tp1": [ReceiverLayout(0, 1)],
    "tp2": [ReceiverLayout(r, 2) for r in range(2)],
    "tp2-ep": [ReceiverLayout(r, 2, expert_parallel=True) for r in range(2)],
}


def _index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box.ranges)


@pytest.fixture(scope="module", params=[ModelFamily.QWEN3_MOE, ModelFamily.MIXTRAL])
def model(request, tmp_path_factory) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """A tiny checkpoint's spec and its HF tensors as saved (one per expert and projection)."""
    family = request.param
    path: Path = write_tiny_checkpoint(
        tmp_path_factory.mktemp(family.value), family, num_layers=2, seed=5
    )
    return ModelSpec.from_pretrained_dir(path), load_hf_state_dict(path)


def grouped(meg: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """A global Megatron state dict with each layer's experts grouped as the trainer publishes
    them: linear_fc1 [E, 2I, H], linear_fc2 [E, H, I]."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in meg.items():
        layer, _, suffix = name.removeprefix("decoder.layers.").partition(".")
        param = parse_expert_suffix(suffix) if name.startswith("decoder.layers.") else None
        if param is None:
            out[name] = tensor
        else:
            group = grouped_expert_name(int(layer), param.fc)
            experts.setdefault(group, {})[param.expert] = tensor
    assert spec.moe is not None
    for group, by_expert in experts.items():
        out[group] = torch.stack([by_expert[e] for e in range(spec.moe.num_experts)])
    return out


def publish_moe(
    meg: Mapping[str, torch.Tensor], spec: ModelSpec, *, ep: int, version: int = 1
) -> tuple[Manifest, dict[str, list[np.ndarray]]]:
    """`meg` (grouped) as a TP=1 trainer at expert parallel `ep` publishes it: EP rank p its
    experts' boxes of the grouped tensors (`expert_group_spec`), every rank a replica of the
    other tensors."""
    records: dict[str, list[ShardRecord]] = {}
    buffers: dict[str, list[np.ndarray]] = {}
    agents = {}
    for p in range(ep):
        agent = f"trainer-rank{p}-slot0"
        specs: list[ShardSpec] = []
        for name, tensor in meg.items():
            grouped_fc = parse_grouped_expert_name(name)
            if grouped_fc is None:
                whole = megatron_shard_spec(name, tensor.shape, DType.FLOAT32, tp_rank=0, tp_size=1)
                specs.append(whole)
            else:
                specs.append(
                    expert_group_spec(
                        name,
                        tensor.shape,
                        DType.FLOAT32,
                        fc=grouped_fc[1],
                        ep_rank=p,
                        ep_size=ep,
                        etp_rank=0,
                        etp_size=1,
                    )
                )
        starts, size = [], 0
        for s in specs:
            starts.append(size)
            size = -(-(size + s.nbytes) // ALIGNMENT) * ALIGNMENT
        arena = np.zeros(size, np.uint8)
        for s, start in zip(specs, starts, strict=True):
            full = meg[s.parameter].contiguous().numpy().view(np.uint8)
            full = full.reshape(*s.shape, DType.FLOAT32.itemsize)
            view = arena[start : start + s.nbytes]
            view[:] = shard_of(full, s).reshape(-1)
            location = ShardLocation.contiguous(
                agent=agent,
                address=arena.ctypes.data + start,
                shape=s.local_shape,
                itemsize=DType.FLOAT32.itemsize,
            )
            records.setdefault(s.parameter, []).append(
                ShardRecord(location, s.pieces, checksum(view), rank=p, expert_rank=p)
            )
        buffers[agent] = [arena]
        agents[agent] = AgentRecord(agent, b"in-memory", rank=p)
    parameters = tuple(
        ParameterRecord(name, tuple(meg[name].shape), DType.FLOAT32, tuple(shards))
        for name, shards in sorted(records.items())
    )
    return Manifest(version, parameters, agents), buffers


def assemble(pull: PullPlan, dest: np.ndarray, hf: HFSlice) -> torch.Tensor:
    dtype = TORCH_DTYPES[pull.targets[hf.parts[0][0]].dtype]
    full = torch.full(hf.shape, float("nan"), dtype=dtype)
    for index, sub_box in hf.parts:
        target = pull.targets[index]
        raw = bytearray(dest[target.span].tobytes())
        full[_index(sub_box)] = torch.frombuffer(raw, dtype=dtype).reshape(target.box.shape)
    return full


def _plans(
    manifest: Manifest, spec: ModelSpec, layouts: list[ReceiverLayout]
) -> list[ReceiverPlan]:
    names = receiver_names(spec, hf_names(spec))
    return [plan_receiver(manifest, spec, layout, names) for layout in layouts]


# -- names ------------------------------------------------------------------------------------


def test_a_receiver_names_fused_targets_instead_of_per_expert_tensors(model) -> None:
    spec, _ = model
    names = receiver_names(spec, hf_names(spec))
    experts = hf_expert_names(spec.family)
    assert not [n for n in names if f"{experts.experts}." in n and ".experts.w" not in n]
    assert f"model.layers.1.{experts.router}" in names  # the router stays an HF tensor
    targets = [parse_target(n) for n in names]
    tail = [t for t in targets if t is not None]
    assert tail == [ExpertTarget(i, t) for i in range(2) for t in FusedExpertTensor]
    assert all(t is not None for t in targets[-len(tail) :])  # after every HF name
    assert target_name(spec, tail[0]) == f"model.layers.0.{experts.experts}.w13_weight"


# -- which boxes ------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", sorted(LAYOUTS))
def test_each_worker_reads_two_or_three_boxes_per_layer_of_its_experts(model, engine: str) -> None:
    """w13 is the gate rows and the up rows of fc1 for all the worker's experts at once (one
    box where the worker holds whole experts: fc1's rows are each expert's [gate; up], w13's
    order), w2 one box of fc2: at TP=2 the halves of each expert's width, with expert
    parallelism half the experts whole. The router and the other tensors are read whole by
    every worker."""
    spec, hf = model
    assert spec.moe is not None
    meg = grouped(hf_to_megatron(hf, spec, padded_vocab_size(spec.vocab_size, 1)), spec)
    manifest, _ = publish_moe(meg, spec, ep=2)
    layouts = LAYOUTS[engine]
    width, experts = spec.moe.ffn_hidden_size, spec.moe.num_experts
    for layout, plan in zip(layouts, _plans(manifest, spec, layouts), strict=True):
        boxes: dict[str, list[Box]] = {}
        for target in plan.pull.targets:
            boxes.setdefault(target.name, []).append(target.box)
        r = layout.tp_rank
        if engine == "tp1":
            mine, cols = (0, experts), (0, width)
        elif engine == "tp2":
            mine, cols = (0, experts), (r * width // 2, (r + 1) * width // 2)
        else:
            mine, cols = (r * experts // 2, (r + 1) * experts // 2), (0, width)
        for layer in range(spec.num_layers):
            fc1 = boxes[grouped_expert_name(layer, 1)]
            fc2 = boxes[grouped_expert_name(layer, 2)]
            if cols == (0, width):
                assert fc1 == [Box((mine, (0, 2 * width), (0, HIDDEN)))]
            else:
                assert fc1 == [
                    Box((mine, cols, (0, HIDDEN))),
                    Box((mine, (width + cols[0], width + cols[1]), (0, HIDDEN))),
                ]
            assert fc2 == [Box((mine, (0, HIDDEN), cols))]
            router = boxes[f"decoder.layers.{layer}.mlp.router.weight"]
            assert router == [Box.full((experts, HIDDEN))]
        # each box comes from the EP ranks that hold its experts, in one read per shard
        by_parameter: dict[str, set[int]] = {}
        for reads in plan.pull.reads:
            if ".experts." in reads.parameter:
                by_parameter.setdefault(reads.parameter, set()).add(reads.shard)
        expected = {0, 1} if mine == (0, experts) else {r}
        assert by_parameter and all(s == expected for s in by_parameter.values())


@pytest.mark.parametrize("engine", sorted(LAYOUTS))
def test_pulled_fused_experts_equal_vllms_from_the_checkpoint(model, engine: str) -> None:
    spec, hf = model
    meg = grouped(hf_to_megatron(hf, spec, padded_vocab_size(spec.vocab_size, 1)), spec)
    manifest, buffers = publish_moe(meg, spec, ep=2)
    transport = InMemoryTransport(buffers)
    layouts = LAYOUTS[engine]
    for layout, plan in zip(layouts, _plans(manifest, spec, layouts), strict=True):
        dest = np.zeros(plan.pull.nbytes, np.uint8)
        transport.pull(plan.pull, Region.of_array(dest), verify=True)
        fused = 0
        for hf_slice in plan.slices:
            got = assemble(plan.pull, dest, hf_slice)
            target = parse_target(hf_slice.name)
            box = _index(hf_slice.box)
            if target is None:
                assert torch.equal(got[box], hf[hf_slice.name][box]), hf_slice.name
                continue
            fused += 1
            assert hf_slice.box == Box.full(hf_slice.shape)
            assert torch.equal(got, fused_experts_of(hf, spec, layout, target)), hf_slice.name
            # a single box (w2, and w13 of whole experts) is a view of staging; w13's
            # halves of a split width are two
            whole = layout.expert_parallel or layout.tp_size == 1
            assert hf_slice.contiguous == (whole or target.tensor is FusedExpertTensor.W2)
        assert fused == 2 * spec.num_layers


# -- refusals ---------------------------------------------------------------------------------


def _moe_spec(experts: int, width: int) -> ModelSpec:
    return synthetic_spec(
        family=ModelFamily.QWEN3_MOE,
        architecture="Qwen3MoeForCausalLM",
        moe=MoESpec(num_experts=experts, top_k=2, ffn_hidden_size=width, norm_topk_prob=True),
    )


def test_a_receiver_refuses_experts_that_do_not_split_naming_the_numbers() -> None:
    spec = _moe_spec(6, 24)
    assert receiver_layout_problems(spec, 1) == []
    assert receiver_layout_problems(spec, 2) == []
    assert receiver_layout_problems(spec, 2, expert_parallel=True) == []
    assert receiver_layout_problems(spec, 4, expert_parallel=True) == [
        "6 experts do not split over expert parallel 4 (vLLM's EP size is its TP size, 4)"
    ]
    assert receiver_layout_problems(_moe_spec(8, 24), 4, expert_parallel=False) == []
    assert receiver_layout_problems(_moe_spec(8, 30), 4) == [
        "the expert width (30) does not split over 4 ranks"
    ]
    # whole experts need no split of their width
    assert receiver_layout_problems(_moe_spec(8, 30), 4, expert_parallel=True) == []
    with pytest.raises(UnsupportedLayout, match=r"TP=4 with expert parallelism: 6 experts"):
        check_receiver_layout(spec, ReceiverLayout(0, 4, expert_parallel=True))


@pytest.mark.parametrize(("experts", "ep"), [(8, 2), (8, 4), (6, 2), (6, 3)])
def test_expert_parallel_shares_are_vllms_linear_placement(experts: int, ep: int) -> None:
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    spec = _moe_spec(experts, 24)
    for rank in range(ep):
        share = expert_share(spec, ReceiverLayout(rank, ep, expert_parallel=True))
        local, expert_map, _ = determine_expert_map(ep, rank, experts)
        assert expert_map is not None and local == share.num_experts
        held = [e for e in range(experts) if expert_map[e] >= 0]
        assert held == list(range(*share.experts))
        assert [int(expert_map[e]) for e in held] == list(range(local))
        assert share.width == (0, 24)


def test_an_engine_whose_experts_differ_is_refused_at_initialisation() -> None:
    """`FusedExperts.find` names what differs before any refit: an expert method it does not
    install into, and layers with no fused experts."""

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w13_weight = torch.nn.Parameter(torch.zeros(8, 64, 64), requires_grad=False)
            self.quant_method = object()

    layer = torch.nn.Module()
    layer.mlp = torch.nn.Module()
    layer.mlp.experts = Experts()
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([layer, torch.nn.Module()])
    spec = _moe_spec(8, 32)
    with pytest.raises(RefitError) as refused:
        FusedExperts.find(model, spec, ReceiverLayout())
    assert str(refused.value) == (
        "the engine's experts differ from refit's: layers.0.mlp.experts: refit installs "
        "unquantized experts, not object; no fused experts found for layers [1]"
    )
