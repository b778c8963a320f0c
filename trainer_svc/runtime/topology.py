"""This rank's place in the TP x PP x DP grid (and, for experts, its ETP x EP x EDP folding),
read once from megatron's parallel_state."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from trainer_svc.config import ParallelLayout


@dataclass(frozen=True, kw_only=True)
class Topology:
    layout: ParallelLayout
    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: Any
    pp_group: Any
    dp_group: Any
    control_group: Any
    """A gloo group over every rank, for broadcasting commands and gathering small results."""
    ep_rank: int = 0
    etp_rank: int = 0
    edp_rank: int = 0
    etp_group: Any = None
    """The ranks that split this rank's experts' width (None: no expert grid)."""
    expert_ranks: Mapping[tuple[int, int, int, int], int] = field(default_factory=dict)
    """Global rank by (pp, ep, etp, edp) rank, where the layout has an expert grid."""
    stage_writer: int = 0
    """The global rank of this stage's TP rank 0 of data-parallel replica 0 (where the layout
    has an expert grid): it writes the stage's exported files."""

    def expert_holder(self, ep_rank: int, etp_rank: int) -> int:
        """The global rank of this stage holding EP rank `ep_rank`'s experts, ETP part
        `etp_rank`, in expert replica 0."""
        return self.expert_ranks[(self.pp_rank, ep_rank, etp_rank, 0)]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pipeline_parallel - 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_parallel_state(cls, layout: ParallelLayout) -> Topology:
        from megatron.core import parallel_state as ps

        control = (
            dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        )
        expert: dict[str, Any] = {}
        if layout.has_expert_grid:
            place = (
                ps.get_pipeline_model_parallel_rank(),
                ps.get_expert_model_parallel_rank(),
                ps.get_expert_tensor_parallel_rank(),
                ps.get_expert_data_parallel_rank(),
                ps.get_tensor_model_parallel_rank(),
                ps.get_data_parallel_rank(),
            )
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, place, group=control)
            (writer,) = [r for r, p in enumerate(every) if p[0] == place[0] and p[4:] == (0, 0)]
            expert = {
                "ep_rank": place[1],
                "etp_rank": place[2],
                "edp_rank": place[3],
                "etp_group": ps.get_expert_tensor_parallel_group(),
                "expert_ranks": {tuple(p[:4]): rank for rank, p in enumerate(every)},
                "stage_writer": writer,
            }
        return cls(
            layout=layout,
            rank=dist.get_rank(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            tp_group=ps.get_tensor_model_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(),
            dp_group=ps.get_data_parallel_group(),
            control_group=control,
            **expert,
        )
