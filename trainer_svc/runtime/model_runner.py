"""Runs packed microbatches through megatron's schedules (any TP/PP) on this rank."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from trainer_svc.runtime import cpu_compat
from trainer_svc.runtime.packing import PackedBatch

LossFunction = Callable[[PackedBatch, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict]]


class ModelRunner:
    def __init__(
        self,
        ddp: torch.nn.Module,
        device: torch.device,
        *,
        before_pass: Callable[[PackedBatch, bool], None] | None = None,
    ) -> None:
        self.ddp = ddp
        self.device = device
        self.before_pass = before_pass
        """Told each pass before the model sees it, and whether it trains (the experts'
        load-balancing loss)."""

    def run(
        self,
        packed: PackedBatch,
        loss_function: LossFunction,
        *,
        forward_only: bool,
        trains: bool = True,
    ) -> list[dict[str, Any]]:
        """One schedule call over one microbatch; returns the last stage's loss dicts.
        `trains` False: a pass whose loss counts for nothing (a filler, `expert_lockstep`)."""

        def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[Any, Any]:
            batch: PackedBatch = next(data_iterator)
            if self.before_pass is not None:
                self.before_pass(batch, trains and not forward_only)
            output = model(batch.inputs, batch.positions, None, packed_seq_params=batch.documents)
            return output, partial(loss_function, batch)

        schedule = get_forward_backward_func()
        context = torch.no_grad() if forward_only else torch.enable_grad()
        with cpu_compat.active(), context:
            return list(
                schedule(
                    forward_step_func=forward_step,
                    data_iterator=iter([packed]),
                    model=[self.ddp],
                    num_microbatches=1,
                    seq_length=packed.width,
                    micro_batch_size=packed.rows,
                    forward_only=forward_only,
                )
            )
