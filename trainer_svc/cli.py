"""Command line of ``trainer-svc``: argv -> TrainerConfig. The parser is importable for checks."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from trainer_refit import auth_flags
from trainer_refit.auth import Role, roles_in
from trainer_svc.config import (
    Attention,
    CudaGraphs,
    Device,
    ExpertsConfig,
    LivenessConfig,
    ModelConfig,
    OptimizerConfig,
    OptimizerKind,
    PackedAttention,
    ParallelLayout,
    ParamsDType,
    Recompute,
    ReferenceConfig,
    ReferencePlacement,
    ReferenceWeights,
    RefitConfig,
    SequenceLayout,
    ServerConfig,
    TrainerConfig,
    UpdateKernels,
)
from trainer_svc.server.access import METHOD_ROLES


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    """Which model, in which dtype and attention, up to which length."""
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        type=Path,
        default=None,
        help="local HF checkpoint or config directory; default: a built-in tiny Llama model",
    )
    model.add_argument("--params-dtype", choices=[d.value for d in ParamsDType], default="float32")
    model.add_argument(
        "--attention",
        choices=[a.value for a in Attention],
        default=Attention.AUTO.value,
        help="core attention: auto (Transformer Engine's where it imports on a GPU, else sdpa), "
        "sdpa (PyTorch's fused kernel) or local (megatron's unfused one)",
    )
    model.add_argument(
        "--recompute",
        choices=[r.value for r in Recompute],
        default=Recompute.NONE.value,
        help="activation recompute in the backward pass: none (default), selective (core "
        "attention) or full (every layer keeps only its input): memory for long sequences",
    )
    model.add_argument(
        "--cuda-graphs",
        choices=[g.value for g in CudaGraphs],
        default=CudaGraphs.NONE.value,
        help="layers: replay CUDA graphs of the transformer layers for training passes of "
        "right-padded rows of at most 4,096 tokens (host-bound small steps; one tensor- and "
        "pipeline-parallel rank, dense models); none (default): run every pass eagerly",
    )
    model.add_argument(
        "--sequence-layout",
        choices=[layout.value for layout in SequenceLayout],
        default=SequenceLayout.AUTO.value,
        help="packed: a pass's sequences back to back in one row, attention kept inside each, "
        "no padding computed (needs the sdpa attention); padded: a row per sequence; auto "
        "(default): with the sdpa attention, each pass packed when padding would add more "
        "than 15%%, padded otherwise",
    )
    model.add_argument(
        "--packed-attention",
        choices=[a.value for a in PackedAttention],
        default=PackedAttention.AUTO.value,
        help="a packed row's attention on a GPU: cudnn (cuDNN's ragged-layout attention; "
        "Hopper or newer, with nvidia-cudnn-frontend installed), flash (the variable-length "
        "flash kernel) or auto (default: cudnn where it runs, else flash)",
    )
    model.add_argument(
        "--reference-policy",
        choices=[r.value for r in ReferenceWeights],
        default=ReferenceWeights.NONE.value,
        help="initial: keep a frozen copy of the start-up weights and compute the KL term's "
        "reference logprobs in TrainMicrobatch for steps that ask (LossConfig."
        "reference_source SERVICE); none (default): clients send reference_logprobs",
    )
    model.add_argument(
        "--reference-placement",
        choices=[p.value for p in ReferencePlacement],
        default=ReferencePlacement.DEVICE.value,
        help="where the reference copy lives: device (default; twice each rank's weights in "
        "device memory) or host (pinned host memory, none on the device; three host-device "
        "copies of the rank's weights per pass that uses it)",
    )
    model.add_argument(
        "--deterministic",
        action="store_true",
        help="bit-identical losses and weights from run to run: deterministic kernels only, "
        "at some speed (default: the fastest kernels, reproducible up to rounding on a GPU)",
    )
    model.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="longest accepted sequence (default: the model's max_position_embeddings)",
    )
    model.add_argument(
        "--vocab-multiple",
        type=int,
        default=128,
        help="pad the vocab to a multiple of this times TP",
    )


def _add_layout_flags(parser: argparse.ArgumentParser) -> None:
    """The parallel layout and the optimizer defaults."""
    layout = parser.add_argument_group("parallel layout (world size = tp * pp * dp)")
    layout.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    layout.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    layout.add_argument("--dp", type=int, default=1, help="data-parallel size")
    layout.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size (mixture-of-experts models): whole experts dealt out over "
        "the TP x DP ranks of each stage",
    )
    layout.add_argument(
        "--etp",
        type=int,
        default=1,
        help="expert-tensor-parallel size: each expert's width split this many ways (default "
        "1, as megatron recommends); EP x ETP must divide TP x DP",
    )
    layout.add_argument(
        "--moe-aux-loss-coeff",
        type=float,
        default=ExpertsConfig.aux_loss_coeff,
        help="weight of the mixture-of-experts load-balancing loss (default 0: off)",
    )
    layout.add_argument(
        "--moe-freeze-router",
        action="store_true",
        help="keep the mixture-of-experts routers' weights as loaded (the experts still train)",
    )
    layout.add_argument("--device", choices=[d.value for d in Device], default="auto")
    optim = parser.add_argument_group("optimizer defaults (BeginTrainStep may override)")
    optim.add_argument("--optimizer", choices=[k.value for k in OptimizerKind], default="adam")
    optim.add_argument("--lr", type=float, default=OptimizerConfig.learning_rate)
    optim.add_argument("--weight-decay", type=float, default=OptimizerConfig.weight_decay)
    optim.add_argument("--max-grad-norm", type=float, default=OptimizerConfig.max_grad_norm)
    optim.add_argument(
        "--update-kernels",
        choices=[k.value for k in UpdateKernels],
        default=OptimizerConfig.kernels.value,
        help="without Transformer Engine or Apex: 'fused' (default) runs the gradient norm and "
        "copies as multi-tensor ops and Adam fused on CUDA; 'stock' runs megatron-core's "
        "per-tensor fallback (to compare against)",
    )


def _add_server_flags(parser: argparse.ArgumentParser) -> None:
    """The gRPC edge and its request limits."""
    server = parser.add_argument_group("server")
    server.add_argument("--host", default=ServerConfig.host)
    server.add_argument("--port", type=int, default=ServerConfig.port, help="0 picks a free port")
    server.add_argument(
        "--port-file", type=Path, default=None, help="write the bound port here once serving"
    )
    server.add_argument(
        "--max-microbatch-tokens", type=int, default=ServerConfig.max_microbatch_tokens
    )
    server.add_argument(
        "--pass-token-budget",
        type=int,
        default=None,
        help="tokens per forward/backward pass on a rank: a larger share of a request runs in "
        "several passes with the same result (default: derived from the model and the free "
        "device memory; reported by GetStatus)",
    )


def _add_refit_flags(parser: argparse.ArgumentParser) -> None:
    """Publication to the refit sidecar (the sidecar client's credentials come from
    `auth_flags`)."""
    refit = parser.add_argument_group("refit publication")
    refit.add_argument(
        "--sidecar",
        default=None,
        help="HOST:PORT of the refit sidecar; each finished step is then published to it",
    )
    refit.add_argument(
        "--refit-slots",
        type=int,
        default=RefitConfig.slots,
        help="snapshot slots per rank (versions readable or leased at once)",
    )
    refit.add_argument(
        "--refit-first-piece-bytes",
        type=int,
        default=RefitConfig.first_piece_bytes,
        help="bytes of the snapshot copy's first piece: receivers read each piece once it "
        "landed, each next piece twice as long; 0: read once the whole copy landed",
    )
    refit.add_argument(
        "--refit-publish-every",
        type=int,
        default=RefitConfig.publish_every,
        metavar="K",
        help="publish a finished step's version only when it is a multiple of K (the last of "
        "every K optimizer steps); loaded checkpoints are always published",
    )
    refit.add_argument(
        "--refit-publish-start",
        action="store_true",
        help="publish the weights the trainer starts with as version 1 before serving, so "
        "that inference engines started before the first step are ready at once (the first "
        "step then makes version 2)",
    )
    refit.add_argument(
        "--refit-take-over",
        action="store_true",
        help="register with the sidecar even while another trainer's registration is alive "
        "(that trainer publishes nothing more there); default: wait for it to lapse, bounded",
    )
    refit.add_argument(
        "--refit-report-deadline-seconds",
        type=float,
        default=RefitConfig.report_deadline_s,
        help="how long the ranks retry a version's failed reports, and rank 0 waits for every "
        "rank's, before the version counts as failed (never readable)",
    )
    refit.add_argument(
        "--nixl-host",
        default=RefitConfig.nixl_host,
        help="an IP address of the network interface the ranks' NIXL endpoints listen on for "
        "receivers (a pod: its pod IP); 0.0.0.0: every interface; default: loopback, for "
        "receivers on the same host",
    )
    refit.add_argument(
        "--nixl-net-device",
        action="append",
        default=[],
        dest="nixl_net_devices",
        metavar="DEVICE",
        help="an RDMA port (UCX name, e.g. mlx5_0:1) NIXL may use besides the interface of "
        "--nixl-host (repeatable)",
    )


def _add_process_flags(parser: argparse.ArgumentParser) -> None:
    """Rank liveness, seed, paths and logging."""
    liveness = parser.add_argument_group("rank liveness")
    liveness.add_argument(
        "--peer-timeout-seconds",
        type=float,
        default=LivenessConfig.peer_timeout_seconds,
        help="a rank silent this long counts as dead (a dead process is noticed at once); "
        "rank 0 then answers UNAVAILABLE and exits non-zero",
    )
    parser.add_argument("--seed", type=int, default=TrainerConfig.seed)
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="where the built-in model is written"
    )
    parser.add_argument(
        "--path-root",
        type=Path,
        action="append",
        default=[],
        dest="path_roots",
        metavar="DIR",
        help="an absolute directory that SaveCheckpoint, LoadCheckpoint and ExportHF paths must "
        "resolve into (repeatable; a relative request path lies under the first); default: "
        "the work dir (a temporary one, removed at exit, without --work-dir)",
    )
    parser.add_argument(
        "--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], default="INFO"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainer-svc",
        description=(
            "Serve a Megatron-core trainer over gRPC (split training step, forward, checkpoints). "
            "Without a torchrun environment it starts TP*PP*DP local ranks itself; under torchrun "
            "(RANK/WORLD_SIZE set) each process is one rank and rank 0 serves gRPC."
        ),
    )
    _add_model_flags(parser)
    _add_layout_flags(parser)
    _add_server_flags(parser)
    auth_flags.add_server_flags(parser)
    _add_refit_flags(parser)
    auth_flags.add_client_flags(parser, "sidecar", Role.TRAINER)
    _add_process_flags(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> TrainerConfig:
    return TrainerConfig(
        model=ModelConfig(
            hf_path=args.model,
            params_dtype=ParamsDType(args.params_dtype),
            attention=Attention(args.attention),
            recompute=Recompute(args.recompute),
            cuda_graphs=CudaGraphs(args.cuda_graphs),
            sequence_layout=SequenceLayout(args.sequence_layout),
            packed_attention=PackedAttention(args.packed_attention),
            deterministic=args.deterministic,
            vocab_multiple=args.vocab_multiple,
            max_sequence_length=args.max_seq_len,
            experts=ExpertsConfig(
                aux_loss_coeff=args.moe_aux_loss_coeff, freeze_router=args.moe_freeze_router
            ),
        ),
        layout=ParallelLayout(
            tensor_parallel=args.tp,
            pipeline_parallel=args.pp,
            data_parallel=args.dp,
            expert_parallel=args.ep,
            expert_tensor_parallel=args.etp,
        ),
        optimizer=OptimizerConfig(
            kind=OptimizerKind(args.optimizer),
            learning_rate=args.lr,
            weight_decay=args.weight_decay,
            max_grad_norm=args.max_grad_norm,
            kernels=UpdateKernels(args.update_kernels),
        ),
        server=ServerConfig(
            host=args.host,
            port=args.port,
            port_file=args.port_file,
            max_microbatch_tokens=args.max_microbatch_tokens,
            pass_token_budget=args.pass_token_budget,
            auth=auth_flags.server_auth(args, roles_in(METHOD_ROLES)),
        ),
        refit=RefitConfig(
            sidecar=args.sidecar,
            slots=args.refit_slots,
            first_piece_bytes=args.refit_first_piece_bytes,
            publish_every=args.refit_publish_every,
            publish_start=args.refit_publish_start,
            take_over=args.refit_take_over,
            report_deadline_s=args.refit_report_deadline_seconds,
            auth=auth_flags.client_auth(args, "sidecar", used=args.sidecar is not None),
            nixl_host=args.nixl_host,
            nixl_net_devices=tuple(args.nixl_net_devices),
        ),
        liveness=LivenessConfig(peer_timeout_seconds=args.peer_timeout_seconds),
        device=Device(args.device),
        reference=ReferenceConfig(
            weights=ReferenceWeights(args.reference_policy),
            placement=ReferencePlacement(args.reference_placement),
        ),
        seed=args.seed,
        work_dir=args.work_dir,
        path_roots=tuple(args.path_roots),
    )


def parse_config(argv: Sequence[str] | None = None) -> tuple[TrainerConfig, str]:
    """Returns the config and the log level; exits with a usage error for invalid values."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return config_from_args(args), args.log_level
    except ValueError as exc:
        parser.error(str(exc))
