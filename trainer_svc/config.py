"""Typed, frozen configuration of the trainer service. Built once by the CLI, passed explicitly."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from pathlib import Path

from refit_sidecar.core.network import NixlNetwork
from refit_sidecar.publish.slot_layout import DEFAULT_FIRST_PIECE_BYTES
from trainer_refit.auth import ClientAuth, ServerAuth


class OptimizerKind(enum.Enum):
    ADAM = "adam"
    SGD = "sgd"


class Recompute(enum.Enum):
    """Which activations the backward pass recomputes instead of keeping (megatron-core's
    activation recompute): memory for longer sequences, paid for in compute."""

    NONE = "none"
    SELECTIVE = "selective"
    """Core attention only: its score-sized activations, for little compute."""
    FULL = "full"
    """Every transformer layer, keeping only its input: one more forward per step."""


class CudaGraphs(enum.Enum):
    """Whether small training passes replay CUDA graphs of the transformer layers
    (`runtime/layer_graphs.py`)."""

    NONE = "none"
    LAYERS = "layers"
    """A forward and a backward graph per layer and pass shape, for passes of right-padded rows
    of at most a few thousand tokens: the host launches two graphs per layer instead of a
    hundred kernels."""


class UpdateKernels(enum.Enum):
    """How the optimizer update runs when neither Transformer Engine nor Apex is installed
    (`runtime/update_kernels.py`)."""

    FUSED = "fused"
    """torch's multi-tensor ops for the norm and copies, its fused Adam(W) on CUDA."""
    STOCK = "stock"
    """megatron-core's own fallback: per-tensor loops and torch's foreach Adam(W)."""


class ParamsDType(enum.Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


class Attention(enum.Enum):
    """The core attention kernel of the layers."""

    AUTO = "auto"
    """Transformer Engine's on a GPU where it imports, else SDPA."""
    SDPA = "sdpa"
    """PyTorch's fused scaled-dot-product attention (`runtime/sdpa_attention.py`)."""
    LOCAL = "local"
    """megatron's local DotProductAttention: two matmuls around an fp32 softmax."""


class SequenceLayout(enum.Enum):
    """How a pass's sequences are laid out for the model (`runtime/packing.py`)."""

    AUTO = "auto"
    """Where the core attention can keep sequences apart (SDPA): each pass packed when its
    padded rows would compute noticeably more than its tokens (`documents.packs`), padded
    otherwise; padded everywhere else."""
    PACKED = "packed"
    """All of a pass's sequences in one row, attention inside each: no padding computed."""
    PADDED = "padded"
    """One row per sequence, right-padded to the longest."""


class PackedAttention(enum.Enum):
    """Which kernel runs a packed row's attention on a GPU in half precision
    (`runtime/sdpa_attention.py`); the CPU and float32 attend sequence by sequence either way."""

    AUTO = "auto"
    """cuDNN's ragged-layout attention where it runs (Hopper or newer, cuDNN's frontend
    installed), else the variable-length flash kernel."""
    CUDNN = "cudnn"
    """cuDNN's ragged-layout attention (`runtime/ragged_attention.py`); a GPU rank that cannot
    run it refuses to start. A row whose graphs cuDNN will not build runs flash (logged)."""
    FLASH = "flash"
    """PyTorch's variable-length flash kernel (FA2)."""


class ReferenceWeights(enum.Enum):
    """Which weights the service keeps frozen for the KL term's reference logprobs
    (`runtime/reference_policy.py`)."""

    NONE = "none"
    INITIAL = "initial"
    """The weights the service started with (the checkpoint it loaded, or its seed's)."""


class ReferencePlacement(enum.Enum):
    """Where the reference copy lives between the passes that use it."""

    DEVICE = "device"
    """Beside the model: twice the rank's weights in device memory (the copy and a scratch
    for the trained weights while it is swapped in), two device-local copies per pass."""
    HOST = "host"
    """In pinned host memory: no device memory, three host-device copies of the rank's
    weights per pass (the trained weights out and back, the reference in)."""


@dataclass(frozen=True, kw_only=True)
class ReferenceConfig:
    weights: ReferenceWeights = ReferenceWeights.NONE
    placement: ReferencePlacement = ReferencePlacement.DEVICE


class Device(enum.Enum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Sizes of the rank grid; ranks are ordered tp-fastest, then dp, then pp (as in Megatron).

    A mixture-of-experts model's experts are laid out on the same ranks folded another way
    (megatron's "parallel folding"): each stage's TP x DP ranks form an ETP x EP x EDP grid,
    ETP splitting each expert's width, EP dealing out whole experts, EDP replicating them."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: int = 1
    """1 by default, as megatron's MoE guide recommends: each expert whole on its rank."""

    def __post_init__(self) -> None:
        for name in (
            "tensor_parallel",
            "pipeline_parallel",
            "data_parallel",
            "expert_parallel",
            "expert_tensor_parallel",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        stage_ranks = self.tensor_parallel * self.data_parallel
        expert_ranks = self.expert_parallel * self.expert_tensor_parallel
        if stage_ranks % expert_ranks:
            raise ValueError(
                f"expert parallel {self.expert_parallel} x expert tensor parallel "
                f"{self.expert_tensor_parallel} = {expert_ranks} does not divide the "
                f"{stage_ranks} ranks of a pipeline stage (TP {self.tensor_parallel} x DP "
                f"{self.data_parallel})"
            )

    @property
    def expert_data_parallel(self) -> int:
        """Replicas of each expert within a pipeline stage."""
        return (
            self.tensor_parallel
            * self.data_parallel
            // (self.expert_parallel * self.expert_tensor_parallel)
        )

    @property
    def has_expert_grid(self) -> bool:
        return self.expert_parallel * self.expert_tensor_parallel > 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel

    def describe(self) -> str:
        experts = (
            f"EP={self.expert_parallel} ETP={self.expert_tensor_parallel} "
            if self.has_expert_grid
            else ""
        )
        return (
            f"TP={self.tensor_parallel} PP={self.pipeline_parallel} DP={self.data_parallel} "
            f"{experts}(world size {self.world_size})"
        )


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Defaults of the optimizer; BeginTrainStep may override the hyper-parameters per step."""

    kind: OptimizerKind = OptimizerKind.ADAM
    learning_rate: float = 1e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 turns clipping off."""
    kernels: UpdateKernels = UpdateKernels.FUSED

    def __post_init__(self) -> None:
        for name in ("learning_rate", "weight_decay", "max_grad_norm", "adam_eps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite value >= 0, got {value}")
        if not (0.0 <= self.adam_beta1 < 1.0 and 0.0 <= self.adam_beta2 < 1.0):
            raise ValueError("adam betas must lie in [0, 1)")
        if self.adam_eps <= 0:
            raise ValueError("adam_eps must be > 0")


@dataclass(frozen=True, kw_only=True)
class ExpertsConfig:
    """How a mixture-of-experts model's routing trains (ignored for a dense model)."""

    aux_loss_coeff: float = 0.0
    """Weight of megatron's load-balancing loss (Switch-style, per pass); 0 turns it off, as
    RL post-training usually runs: the router then learns from the policy loss alone."""

    freeze_router: bool = False
    """Keep every router's weights as loaded: the experts and the rest train, which expert a
    token goes to changes only through its hidden state (RL setups often freeze it)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.aux_loss_coeff) and self.aux_loss_coeff >= 0):
            raise ValueError(
                f"the load-balancing loss coefficient must be finite and >= 0, got "
                f"{self.aux_loss_coeff}"
            )


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    hf_path: Path | None = None
    """A local HF checkpoint (config.json, optionally *.safetensors) or config-only directory.
    None builds the embedded tiny Llama-family model."""
    params_dtype: ParamsDType = ParamsDType.FLOAT32
    attention: Attention = Attention.AUTO
    recompute: Recompute = Recompute.NONE
    cuda_graphs: CudaGraphs = CudaGraphs.NONE
    sequence_layout: SequenceLayout = SequenceLayout.AUTO
    packed_attention: PackedAttention = PackedAttention.AUTO
    deterministic: bool = False
    """Bit-identical steps from run to run, at some speed (`runtime/determinism.py`)."""
    vocab_multiple: int = 128
    """Vocab rows are padded to a multiple of vocab_multiple * tensor_parallel."""
    max_sequence_length: int | None = None
    """Longest accepted sequence; None uses the model's max_position_embeddings."""
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)

    def __post_init__(self) -> None:
        if self.vocab_multiple < 1:
            raise ValueError("vocab_multiple must be >= 1")
        if self.max_sequence_length is not None and self.max_sequence_length < 2:
            raise ValueError("max_sequence_length must be >= 2")
        if self.cuda_graphs is CudaGraphs.LAYERS and self.recompute is not Recompute.NONE:
            raise ValueError(
                "--cuda-graphs layers cannot run with --recompute: recompute reruns a layer's "
                "forward inside its backward"
            )
        if self.sequence_layout is SequenceLayout.PACKED and self.attention is Attention.LOCAL:
            raise ValueError(
                "packed sequences need an attention that keeps them apart: use --attention "
                "sdpa (or auto) with --sequence-layout packed"
            )


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 50051
    """0 picks a free port; the bound port is logged and written to port_file when given."""
    port_file: Path | None = None
    max_message_bytes: int = 256 * 1024 * 1024
    max_microbatch_tokens: int = 1 << 20
    """A TrainMicrobatch or Forward request with more tokens than this is rejected."""
    pass_token_budget: int | None = None
    """Tokens per forward/backward pass on a rank; a request's share with more runs in several
    passes with the same result (`runtime/passes.py`). None: derived from the model and the
    device's free memory at start."""
    grace_seconds: float = 5.0
    auth: ServerAuth = field(default_factory=lambda: ServerAuth(insecure=True))
    """Who may call (docs/security.md). The CLI never falls back to this default: it needs
    --auth-token-dir or an explicit --insecure."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_message_bytes < 1024 or self.max_microbatch_tokens < 1:
            raise ValueError("max_message_bytes must be >= 1024 and max_microbatch_tokens >= 1")
        if self.pass_token_budget is not None and self.pass_token_budget < 1:
            raise ValueError(f"pass_token_budget must be >= 1, got {self.pass_token_budget}")


@dataclass(frozen=True, kw_only=True)
class RefitConfig:
    sidecar: str | None = None
    """HOST:PORT of the refit sidecar; None publishes nothing."""
    slots: int = 2
    """Snapshot slots per rank: versions that can be readable (or leased) at once."""
    auth: ClientAuth = field(default_factory=lambda: ClientAuth(insecure=True))
    """How the ranks authenticate at the sidecar (the trainer role's token file)."""
    nixl_host: str = "127.0.0.1"
    """An address of the network interface each rank's NIXL (UCX) endpoints listen on, which
    receivers read the published weights from (`refit_sidecar/core/network.py`); 0.0.0.0:
    every interface. The default serves receivers on the same host only; a pod gives its IP."""
    nixl_net_devices: tuple[str, ...] = ()
    """RDMA ports (``mlx5_0:1``) the NIXL endpoints may use besides that interface."""
    first_piece_bytes: int = DEFAULT_FIRST_PIECE_BYTES
    """The snapshot copy's first piece: receivers read each piece once it landed, each next
    piece twice as long (`refit_sidecar.publish.slot_layout.piece_ends`); 0: one piece, read once
    the whole copy landed."""
    publish_every: int = 1
    """A finished step publishes its version when the version is a multiple of this: 1, every
    step; k, the last of every k optimizer steps (a loop that updates k times per rollout
    batch). A loaded checkpoint is always published. Receivers that ask for a version before
    it exists (`Receiver.expect`) must ask for published ones."""
    publish_start: bool = False
    """Publish the weights the trainer started with (an HF import or megatron's
    initialisation) as version 1 before serving, so that receivers started before the first
    step are ready at once; the first step then makes version 2. Off: the first step makes
    version 1, and receivers have nothing to install until then."""
    take_over: bool = False
    """Register with the sidecar even while another trainer's registration is alive (that
    trainer's ranks are refused from then on). Off: wait for it to lapse, bounded."""
    report_deadline_s: float = 60.0
    """How long the ranks send a version's reports again after failures (the sidecar
    unreachable), and rank 0 waits for every rank's, before the version counts as failed."""

    def __post_init__(self) -> None:
        if self.report_deadline_s <= 0:
            raise ValueError(f"the report deadline must be > 0 s, got {self.report_deadline_s}")
        if self.slots < 1:
            raise ValueError(f"refit slots must be >= 1, got {self.slots}")
        if self.publish_every < 1:
            raise ValueError(f"publish_every must be >= 1, got {self.publish_every}")
        if self.first_piece_bytes < 0:
            raise ValueError(f"the first piece must be >= 0 bytes, got {self.first_piece_bytes}")
        NixlNetwork(host=self.nixl_host, extra_devices=self.nixl_net_devices)  # raises if bad
        if self.sidecar is not None:
            host, _, port = self.sidecar.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--sidecar must be HOST:PORT, got {self.sidecar!r}")


@dataclass(frozen=True, kw_only=True)
class LivenessConfig:
    """How the ranks watch each other, apart from torch.distributed (runtime/liveness.py)."""

    heartbeat_seconds: float = 1.0
    """Period of the heartbeats each rank sends over its link with rank 0."""
    peer_timeout_seconds: float = 10.0
    """A rank silent this long (hung, or its node lost) counts as dead; a rank whose process
    died is noticed at once, from its closed connection. Not shorter: a false death restarts
    the whole world, and a rank whose heartbeat thread waits a few seconds for the GIL (a
    native call that holds it) is not dead."""
    exit_grace_seconds: float = 5.0
    """Rank 0 keeps answering UNAVAILABLE (health NOT_SERVING) this long after a rank died,
    then exits non-zero so that the orchestrator restarts the world."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.heartbeat_seconds) and self.heartbeat_seconds > 0):
            raise ValueError(f"heartbeat_seconds must be > 0, got {self.heartbeat_seconds}")
        timeout = self.peer_timeout_seconds
        if not (math.isfinite(timeout) and timeout >= 2 * self.heartbeat_seconds):
            raise ValueError(
                f"peer_timeout_seconds must be finite and at least twice heartbeat_seconds "
                f"({self.heartbeat_seconds}), got {timeout}"
            )
        if not (math.isfinite(self.exit_grace_seconds) and self.exit_grace_seconds >= 0):
            raise ValueError(f"exit_grace_seconds must be >= 0, got {self.exit_grace_seconds}")


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    refit: RefitConfig = field(default_factory=RefitConfig)
    liveness: LivenessConfig = field(default_factory=LivenessConfig)
    device: Device = Device.AUTO
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    seed: int = 1234
    work_dir: Path | None = None
    """Where the embedded tiny model is written; None uses a temporary directory."""
    path_roots: tuple[Path, ...] = ()
    """Directories SaveCheckpoint, LoadCheckpoint and ExportHF paths must resolve into
    (`runtime/path_roots.py`); a relative request path lies under the first. Empty: the work
    dir alone (the temporary one, removed at exit, when work_dir is None)."""

    def __post_init__(self) -> None:
        for root in self.path_roots:
            if not root.is_absolute():
                raise ValueError(f"--path-root must be an absolute directory, got {str(root)!r}")

    def checkpoint_roots(self) -> tuple[Path, ...]:
        """The path roots in force: path_roots, else the work dir (which the entrypoint sets
        to its temporary directory when none was given)."""
        if self.path_roots:
            return self.path_roots
        if self.work_dir is None:
            raise ValueError("no path roots: give path_roots or a work_dir")
        return (self.work_dir.absolute(),)
