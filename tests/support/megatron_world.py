"""A one-rank torch.distributed world for tests that run megatron modules in the test process
(or a child of it): the process group megatron's collectives need even at size 1, model
parallel state, and the attention config the attention tests share."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


@contextlib.contextmanager
def one_rank_group(rendezvous: Path) -> Iterator[dist.ProcessGroup]:
    """A one-rank gloo group (file rendezvous), destroyed on exit."""
    assert not dist.is_initialized(), "another test left a default process group behind"
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def one_rank_model_parallel(*, cuda: bool) -> None:
    """A one-rank world with megatron's model-parallel state (TP = PP = 1) and seeded RNG
    trackers: nccl on GPU 0, or gloo with the trainer's CPU compatibility layer. For a child
    process (`tests.support.isolation.in_child_process`): it is never torn down."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cuda:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
    else:
        from trainer_svc.runtime import cpu_compat

        dist.init_process_group("gloo", rank=0, world_size=1)
        cpu_compat.install()
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)


def attention_config(heads: int, groups: int, dim: int, dtype: torch.dtype) -> Any:
    """A one-layer TransformerConfig for core-attention modules: `heads` query heads of `dim`
    channels over `groups` key/value groups, no dropout, the trainer's fp32 softmax."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=heads * dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=dim,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        masked_softmax_fusion=False,
        bf16=dtype is torch.bfloat16,
        params_dtype=dtype,
        use_cpu_initialization=True,
    )


def cpu_model(model_dir: Path, **options: Any) -> tuple[Any, Any, torch.Tensor]:
    """The trainer's model of the HF directory `model_dir` on the CPU, float32, in a world of
    `one_rank_model_parallel` (call inside `cpu_compat.active()`), built with `build_model`'s
    `options`; with it its TransformerConfig and a seeded [2, 16] batch of token ids."""
    from megatron_hf.spec import ModelSpec
    from trainer_svc.config import ParallelLayout, ParamsDType
    from trainer_svc.runtime.model_factory import build_model
    from trainer_svc.runtime.topology import Topology

    spec = ModelSpec.from_pretrained_dir(model_dir)
    model, config = build_model(
        spec,
        Topology.from_parallel_state(ParallelLayout()),
        padded_vocab=128,
        max_sequence_length=32,
        params_dtype=ParamsDType.FLOAT32,
        on_gpu=False,
        **options,
    )
    tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    return model, config, tokens


def lm_loss(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """The summed next-token loss of `tokens` (labels = inputs), positions 0..n-1."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, positions, None, labels=tokens).sum()
