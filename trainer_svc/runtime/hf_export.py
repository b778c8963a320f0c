"""ExportHF without a whole-model gather: each pipeline stage writes its own files of a sharded
HF checkpoint (`megatron_hf.export_plan`), in parallel with the other stages, one parameter at a
time; rank 0 writes the index and config last.

A parameter's TP shards, each cast to the export's dtype by its own rank, meet on the stage's
writer (its TP rank 0 of data-parallel replica 0), which converts the parameter to its HF tensors
and appends them to its open file. So a writer holds, besides its own shards, one gathered
parameter and its HF tensors; the other replicas take no part.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_hf.checkpoint import SIDECAR_FILES
from megatron_hf.convert import hf_names_of, megatron_names, megatron_param_to_hf
from megatron_hf.experts import expert_owner, is_expert_name, parse_expert_suffix
from megatron_hf.export_plan import ExportPlan, PlannedFile, plan_export
from megatron_hf.safetensors_file import INDEX_NAME, FileWriter
from megatron_hf.sharding import stage_of, unshard
from megatron_hf.spec import ModelSpec
from trainer_svc.runtime.topology import Topology
from trainer_svc.runtime.weights import local_parameters

log = logging.getLogger(__name__)

_CONFIG_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@dataclass(frozen=True)
class ExportSettings:
    dtype: torch.dtype | None
    """None: each parameter's own dtype (the weights bit for bit)."""
    max_file_bytes: int


def export_plan(
    model: torch.nn.Module, spec: ModelSpec, topology: Topology, settings: ExportSettings
) -> ExportPlan:
    """Collective over every rank when the parameters keep their own dtypes (each stage knows
    only its own): the same plan on every rank."""
    dtype: torch.dtype | dict[str, torch.dtype] | None = settings.dtype
    if dtype is None:
        mine = {name: p.dtype for name, p in local_parameters(model, spec, topology).items()}
        every: list[dict[str, torch.dtype]] = [{} for _ in range(topology.layout.world_size)]
        dist.all_gather_object(every, mine, group=topology.control_group)
        dtype = {name: d for held in every for name, d in held.items()}
    return plan_export(
        spec,
        pipeline_parallel=topology.layout.pipeline_parallel,
        dtype=dtype,
        max_file_bytes=settings.max_file_bytes,
    )


@torch.no_grad()
def write_stage_files(
    model: torch.nn.Module, spec: ModelSpec, topology: Topology, plan: ExportPlan, path: Path
) -> None:
    """Collective over each stage's TP group of replica 0 (and, with an expert grid, the
    ranks holding the stage's experts): writes this stage's files of `plan` into `path` (on the
    writer; the others send their shards)."""
    expert_grid = topology.layout.has_expert_grid
    if topology.dp_rank != 0 and not expert_grid:
        return
    writer = topology.dp_rank == 0 and topology.tp_rank == 0
    files = plan.files_of(topology.pp_rank)
    where = {t.name: (k, t) for k, f in enumerate(files) for t in f.tensors}
    dtypes = {t.name: t.dtype for f in plan.files for t in f.tensors}
    params = local_parameters(model, spec, topology)
    layers, stages = spec.num_layers, topology.layout.pipeline_parallel
    open_files: dict[int, FileWriter] = {}
    opened: set[int] = set()
    failure: Exception | None = None
    try:
        for name in megatron_names(spec):
            if stage_of(name, layers, stages) != topology.pp_rank:
                continue
            # Every HF tensor of a parameter has the parameter's planned dtype.
            cast = dtypes[hf_names_of(name, spec)[0]]
            if expert_grid and is_expert_name(name):
                pieces = _expert_gathered(name, params, cast, spec, topology)
            elif topology.dp_rank != 0:
                continue
            else:
                pieces = _gathered(params[name].detach().to(cast), topology, writer)
            if pieces is None or failure is not None:
                continue  # a failed writer still takes its part in every gather
            try:
                full = unshard(name, pieces)
                for hf_name, tensor in megatron_param_to_hf(name, full, spec).items():
                    k, planned = where[hf_name]
                    if k not in open_files:
                        _close_before(open_files, k)
                        open_files[k] = _open(path, files[k])
                        opened.add(k)
                    open_files[k].write(planned.name, tensor)
            except Exception as e:
                failure = e
            del pieces
        if writer and failure is None:
            _close_before(open_files, len(files))
            if len(opened) != len(files):
                failure = RuntimeError(f"the export plan has files no tensor went to: {files}")
    finally:
        for file in open_files.values():
            file.abandon()
    if failure is not None:
        raise failure


def write_index(plan: ExportPlan, path: Path, spec: ModelSpec, source_dir: Path | None) -> None:
    """Rank 0, once every stage wrote its files: the config (the source's, or the spec's without
    one; its dtype the export's), the index (last: its presence says the export is complete) and
    the tokenizer files."""
    if source_dir is None:
        config = spec.to_hf_config()
    else:
        config = json.loads((source_dir / "config.json").read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = _CONFIG_DTYPE[plan.main_dtype]
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    sources = [source_dir / name for name in SIDECAR_FILES] if source_dir is not None else []
    for source in sources:
        if source.is_file():
            shutil.copyfile(source, path / source.name)
    index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": plan.weight_map()}
    partial = path / (INDEX_NAME + ".partial")
    partial.write_text(json.dumps(index, indent=2) + "\n")
    partial.replace(path / INDEX_NAME)


def _gathered(shard: torch.Tensor, topology: Topology, writer: bool) -> list[torch.Tensor] | None:
    """Every TP rank's shard of a parameter on the writer (None elsewhere), to be joined there
    inside its failure handling, so that nothing a writer does alone can leave its peers in the
    next gather. The shards come cast to the export's dtype (casting commutes with
    concatenation): each rank casts its own, and the writer receives half as many bytes from
    float32."""
    if topology.layout.tensor_parallel == 1:
        return [shard]
    shard = shard.contiguous()
    tp = topology.layout.tensor_parallel
    pieces = [torch.empty_like(shard) for _ in range(tp)] if writer else None
    dst = dist.get_global_rank(topology.tp_group, 0)
    dist.gather(shard, pieces, dst=dst, group=topology.tp_group)
    return pieces


def _expert_gathered(
    name: str,
    params: dict[str, torch.nn.Parameter],
    cast: torch.dtype,
    spec: ModelSpec,
    topology: Topology,
) -> list[torch.Tensor] | None:
    """An expert tensor, whole, on the stage's writer (None elsewhere): its ETP parts meet on
    their ETP rank 0 of expert replica 0, which sends it to the writer. Only the holders and
    the writer take part, every one in the same order of names."""
    assert spec.moe is not None
    param = parse_expert_suffix(name.split(".", 3)[3])
    assert param is not None
    owner, _ = expert_owner(
        param.expert,
        num_experts=spec.moe.num_experts,
        expert_parallel=topology.layout.expert_parallel,
    )
    holder = topology.expert_holder(owner, 0)
    writer = topology.stage_writer
    if topology.ep_rank == owner and topology.edp_rank == 0:
        shard = params[name].detach().to(cast).contiguous()
        etp = topology.layout.expert_tensor_parallel
        if etp > 1:
            first = topology.etp_rank == 0
            pieces = [torch.empty_like(shard) for _ in range(etp)] if first else None
            dst = dist.get_global_rank(topology.etp_group, 0)
            dist.gather(shard, pieces, dst=dst, group=topology.etp_group)
            if pieces is None:
                return None
            shard = unshard(name, pieces).contiguous()
        if topology.rank == writer:
            return [shard]
        dist.send(shard, dst=writer)
        return None
    if topology.rank != writer:
        return None
    width = spec.moe.ffn_hidden_size
    shape = (2 * width, spec.hidden_size) if param.fc == 1 else (spec.hidden_size, width)
    device = next(iter(params.values())).device
    received = torch.empty(shape, dtype=cast, device=device)
    dist.recv(received, src=holder)
    return [received]


def _open(path: Path, planned: PlannedFile) -> FileWriter:
    return FileWriter(path / planned.name, [(t.name, t.shape, t.dtype) for t in planned.tensors])


def _close_before(open_files: dict[int, FileWriter], k: int) -> None:
    """Completes the files before file `k`: tensors arrive in file order."""
    for done in sorted(i for i in open_files if i < k):
        open_files.pop(done).close()
