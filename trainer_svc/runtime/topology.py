"""This rank's place in the TP x PP x DP grid, read once from megatron's parallel_state."""

from __future__ import annotations

from dataclasses import dataclass
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
        )
