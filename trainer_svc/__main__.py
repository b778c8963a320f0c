"""``trainer-svc`` / ``python -m trainer_svc``: parse the config, then run one rank or a world."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

# megatron's checkpoint writer forks worker processes, and a CPU world's ranks are forked from
# their launcher; gRPC's fork handlers must stay out of both (the writer's children never use
# gRPC, and a writer forked while the rank serves would lose its work to them). gRPC reads this
# when it is first imported, which the imports below do.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

from trainer_svc.cli import parse_config
from trainer_svc.config import TrainerConfig


@contextlib.contextmanager
def work_dir(config: TrainerConfig) -> Iterator[Path]:
    """The work dir in use: `config.work_dir`, else a scratch directory removed on exit. None
    is made when one is given (a rank of a local world gets its launcher's), so a process
    killed without cleanup leaves nothing behind."""
    if config.work_dir is not None:
        yield config.work_dir
        return
    with tempfile.TemporaryDirectory(prefix="trainer-svc-") as scratch:
        yield Path(scratch)


def _model_dir(config: TrainerConfig, work: Path) -> Path:
    if config.model.hf_path is not None:
        return config.model.hf_path
    from trainer_svc.builtin_model import write_builtin_model

    return write_builtin_model(work / "builtin-model", seed=config.seed)


def _check_layout(config: TrainerConfig, model_dir: Path) -> None:
    """Exit with a usage error, before any rank starts, when the model cannot be split into
    the requested layout (or its weights cannot be published)."""
    from megatron_hf.spec import ModelSpec
    from megatron_hf.splits import check_trainer_layout

    try:
        spec = ModelSpec.from_pretrained_dir(model_dir)
        check_trainer_layout(
            spec,
            tensor_parallel=config.layout.tensor_parallel,
            pipeline_parallel=config.layout.pipeline_parallel,
            expert_parallel=config.layout.expert_parallel,
            expert_tensor_parallel=config.layout.expert_tensor_parallel,
        )
        if spec.is_moe and config.layout.expert_tensor_parallel > 1 and _on_cpu(config):
            raise ValueError(
                f"expert tensor parallel {config.layout.expert_tensor_parallel} needs GPU "
                "ranks: its uneven all-gathers of routed tokens are not available over gloo"
            )
    except ValueError as e:
        print(f"trainer-svc: error: {e}", file=sys.stderr)
        sys.exit(2)


def _on_cpu(config: TrainerConfig) -> bool:
    """Whether the world's ranks run on the CPU (their launcher may then fork them)."""
    from trainer_svc.config import Device

    if config.device is not Device.AUTO:
        return config.device is Device.CPU
    import torch

    return not torch.cuda.is_available()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    config, log_level = parse_config(argv)
    from trainer_svc.runtime.rank import RankIdentity

    identity = RankIdentity.from_env()
    if identity is not None:
        from trainer_svc.launch import name_process

        name_process(f"trainer-rank{identity.rank}")
    prefix = f"[rank {identity.rank}] " if identity else "[trainer-svc] "
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s {prefix}%(levelname)s %(message)s", force=True
    )
    if log_level != "DEBUG":
        # megatron logs every parameter name and its full config at INFO, and warns about
        # optional fused kernels it cannot find; keep the service's own lines readable.
        logging.getLogger("megatron").setLevel(logging.WARNING)
        warnings.filterwarnings("ignore", module=r"megatron\.")
    with work_dir(config) as work:
        # The work dir in use is the default path root (`TrainerConfig.checkpoint_roots`);
        # the ranks of a local world share the launcher's.
        config = replace(config, work_dir=work)
        model_dir = _model_dir(config, work)
        _check_layout(config, model_dir)
        if identity is not None:
            from trainer_svc.runtime.rank import run_rank

            # A rank exits the usual way: the interpreter's exit also joins or ends the
            # processes megatron's checkpoint writer started.
            run_rank(config, identity, model_dir)
            return
        from trainer_svc.launch import spawn_world

        world_argv = [*argv, "--work-dir", str(work)]
        entry = main if _on_cpu(config) else None
        code = spawn_world(world_argv, config.layout.world_size, model_dir, fork=entry)
    # The launcher's world is down and the scratch directory gone; it started no process but
    # the ranks. What is left is the teardown of the modules it imported (torch, transformers
    # for the built-in model), about two seconds at interpreter exit on every stop: flush and
    # leave.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
