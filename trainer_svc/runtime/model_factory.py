"""Builds this rank's megatron-core GPTModel, its DDP wrapper and optimizer from a ModelSpec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from megatron_hf.spec import ModelSpec
from trainer_svc.config import Attention, ExpertsConfig, OptimizerConfig, ParamsDType, Recompute
from trainer_svc.runtime import moe_compat, norms, rotary, update_kernels
from trainer_svc.runtime.load_balancing import SequenceBalancing
from trainer_svc.runtime.sdpa_attention import SdpaAttention
from trainer_svc.runtime.topology import Topology

_DTYPES = {ParamsDType.FLOAT32: torch.float32, ParamsDType.BFLOAT16: torch.bfloat16}


@dataclass
class BuiltModel:
    model: GPTModel
    ddp: DistributedDataParallel
    optimizer: Any
    config: TransformerConfig
    balancing: SequenceBalancing | None = None
    """A mixture-of-experts model's routing account and load-balancing loss (None: dense)."""


def transformer_engine_available() -> bool:
    """True when Transformer Engine imports; then GPU ranks use megatron's TE layer spec."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


_RECOMPUTE: dict[Recompute, dict[str, Any]] = {
    Recompute.NONE: {},
    Recompute.SELECTIVE: {"recompute_granularity": "selective"},  # megatron: core attention
    Recompute.FULL: {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,  # each layer its own checkpoint: only layer inputs kept
    },
}


def transformer_config(
    spec: ModelSpec,
    topology: Topology,
    params_dtype: ParamsDType,
    on_gpu: bool,
    *,
    recompute: Recompute = Recompute.NONE,
    deterministic: bool = False,
    grouped_experts: bool = False,
) -> TransformerConfig:
    dtype = _DTYPES[params_dtype]
    return TransformerConfig(
        **_RECOMPUTE[recompute],
        **_moe_settings(spec, topology, grouped=grouped_experts),
        deterministic_mode=deterministic,
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        softmax_scale=rotary.softmax_scale(spec),
        tensor_model_parallel_size=topology.layout.tensor_parallel,
        sequence_parallel=sequence_parallel(spec, topology),
        pipeline_model_parallel_size=topology.layout.pipeline_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        use_cpu_initialization=not on_gpu,
        calculate_per_token_loss=True,
        batch_p2p_comm=on_gpu,
        init_method_std=0.02,
    )


def sequence_parallel(spec: ModelSpec, topology: Topology) -> bool:
    """Whether the model runs sequence-parallel: a mixture-of-experts model under TP > 1,
    where megatron's expert layers need each TP rank to route its own part of the sequence
    (with every rank routing the whole sequence, each expert would see, and be trained on,
    every token TP times). Dense models keep whole sequences on every TP rank."""
    return spec.moe is not None and topology.layout.tensor_parallel > 1


def _moe_settings(spec: ModelSpec, topology: Topology, *, grouped: bool) -> dict[str, Any]:
    """megatron's MoE settings for HF's top-k softmax router: with `norm_topk_prob` a softmax
    over the chosen experts' logits (megatron's default order: top-k first), without it each
    chosen expert keeps its share of the softmax over all (`moe_router_pre_softmax`). The
    router computes in fp32 whatever the parameters' dtype; megatron's per-pass load-balancing
    loss stays off (`load_balancing.SequenceBalancing` replaces it)."""
    moe = spec.moe
    if moe is None:
        return {}
    layout = topology.layout
    return {
        "num_moe_experts": moe.num_experts,
        "moe_ffn_hidden_size": moe.ffn_hidden_size,
        "moe_router_topk": moe.top_k,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not moe.norm_topk_prob,
        "moe_router_dtype": "fp32",
        # The load-balancing loss, when asked for, is the trainer's own (`load_balancing`).
        "moe_router_load_balancing_type": "none",
        # Each router can replay given routing (`routing_replay`); idle unless asked to.
        "moe_enable_routing_replay": True,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": grouped,
        "expert_model_parallel_size": layout.expert_parallel,
        "expert_tensor_parallel_size": layout.expert_tensor_parallel,
    }


def uses_transformer_engine(attention: Attention, *, on_gpu: bool) -> bool:
    """Whether the layers are Transformer Engine's (then experts run as one grouped GEMM)."""
    return attention is Attention.AUTO and on_gpu and transformer_engine_available()


def layer_spec_for(spec: ModelSpec, attention: Attention, *, on_gpu: bool) -> ModuleSpec:
    """Transformer Engine's layer spec where it is asked for (auto: on a GPU where it imports);
    otherwise megatron's local spec, with its core attention replaced by `SdpaAttention` unless
    `Attention.LOCAL` is asked for."""
    experts = spec.moe.num_experts if spec.moe is not None else None
    if uses_transformer_engine(attention, on_gpu=on_gpu):
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts,
            moe_grouped_gemm=experts is not None,
            qk_layernorm=spec.qk_layernorm,
        )
    # Without Transformer Engine: SequentialMLP, each local expert its own pair of linears.
    layer_spec = get_gpt_layer_local_spec(
        num_experts=experts, qk_layernorm=spec.qk_layernorm, normalization="RMSNorm"
    )
    if attention is not Attention.LOCAL:
        self_attention = layer_spec.submodules.self_attention
        self_attention.submodules.core_attention = SdpaAttention
    return layer_spec


def build_model(
    spec: ModelSpec,
    topology: Topology,
    *,
    padded_vocab: int,
    max_sequence_length: int,
    params_dtype: ParamsDType,
    on_gpu: bool,
    attention: Attention = Attention.AUTO,
    recompute: Recompute = Recompute.NONE,
    deterministic: bool = False,
) -> tuple[GPTModel, TransformerConfig]:
    config = transformer_config(
        spec,
        topology,
        params_dtype,
        on_gpu,
        recompute=recompute,
        deterministic=deterministic,
        grouped_experts=spec.is_moe and uses_transformer_engine(attention, on_gpu=on_gpu),
    )
    layer_spec: Any = layer_spec_for(spec, attention, on_gpu=on_gpu)
    if config.sequence_parallel and not uses_transformer_engine(attention, on_gpu=on_gpu):
        # The block's final norm too: a block spec names it.
        layer_spec = TransformerBlockSubmodules(
            layer_specs=[norms.with_sequence_parallel_norms(layer_spec)]
            * get_num_layers_to_build(config, pp_rank=topology.pp_rank),
            layer_norm=norms.SequenceParallelRMSNorm,
        )
    if spec.is_moe:
        moe_compat.install()
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab,
        max_sequence_length=max_sequence_length,
        pre_process=topology.is_first_stage,
        post_process=topology.is_last_stage,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta)
        if float(spec.rope_theta).is_integer()
        else spec.rope_theta,
        parallel_output=True,
    )
    if spec.pad_token_id is not None and topology.is_first_stage:
        freeze_padding_row(model, spec.pad_token_id)
    if on_gpu:
        model.cuda(torch.cuda.current_device())
    norms.install(model)
    # Megatron's rotary is built plain; transformers' (scaled) frequencies replace its own.
    rotary.install_frequencies(model, spec)
    rotary.check_softmax_scale(model, spec)
    return model, config


def freeze_padding_row(model: GPTModel, pad_token_id: int) -> None:
    """Looking up `pad_token_id` gives its embedding row no gradient, as HF's embedding
    (`nn.Embedding(padding_idx=pad_token_id)`, `megatron_hf.spec.padding_row`) does.

    The word embedding's output at the pad token's positions is detached after megatron's
    vocab-parallel all-reduce, its value unchanged: on whichever TP rank owns the row the
    lookup then adds nothing to the row's gradient (the other ranks' lookups of it are masked
    to zero anyway). An output layer tied to the embedding still trains the row through the
    logits, as HF's tied lm_head does; under PP the last stage's copy of the tied weight
    brings that part in at the embedding-group reduction. Sequence-parallel, the lookup's
    output is already this TP rank's part of the sequence, ``[seq / TP, batch, hidden]``."""
    embedding = model.embedding.word_embeddings
    scattered = bool(embedding.reduce_scatter_embeddings)

    def detach_pad_positions(
        module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor
    ) -> torch.Tensor:
        if not output.requires_grad:
            return output  # a forward-only pass trains nothing
        is_pad = args[0] == pad_token_id
        if scattered:
            part = output.shape[0]
            rank = parallel_state.get_tensor_model_parallel_rank()
            is_pad = is_pad.t()[rank * part : (rank + 1) * part]
        return torch.where(is_pad.unsqueeze(-1), output.detach(), output)

    embedding.register_forward_hook(detach_pad_positions)


def freeze_routers(model: GPTModel) -> None:
    """Routers take no gradient and so no update: DDP and the optimizer leave out parameters
    that do not require one."""
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.weight.requires_grad_(False)


def wrap_for_training(
    model: GPTModel,
    config: TransformerConfig,
    topology: Topology,
    optimizer: OptimizerConfig,
    experts: ExpertsConfig | None = None,
) -> BuiltModel:
    if experts is not None and experts.freeze_router:
        freeze_routers(model)
    distributed = topology.layout.data_parallel > 1
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=distributed,
        ),
        model,
    )
    update_kernels.install(optimizer.kernels)
    megatron_optimizer = get_megatron_optimizer(
        MegatronOptimizerConfig(
            optimizer=optimizer.kind.value,
            lr=optimizer.learning_rate,
            weight_decay=optimizer.weight_decay,
            adam_beta1=optimizer.adam_beta1,
            adam_beta2=optimizer.adam_beta2,
            adam_eps=optimizer.adam_eps,
            clip_grad=optimizer.max_grad_norm,
            bf16=config.bf16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=distributed,
        ),
        [ddp],
    )
    update_kernels.use_fused_adam(megatron_optimizer, optimizer.kernels)
    _initialize_optimizer_state(megatron_optimizer)
    # The step engine reduces gradients itself, once per step (see engine.finish).
    config.finalize_model_grads_func = None
    coeff = experts.aux_loss_coeff if experts is not None else 0.0
    balancing = (
        SequenceBalancing(model, coeff, config.num_layers) if config.num_moe_experts else None
    )
    return BuiltModel(
        model=model, ddp=ddp, optimizer=megatron_optimizer, config=config, balancing=balancing
    )


def _initialize_optimizer_state(optimizer: Any) -> None:
    """Creates the optimizer's per-parameter state now, with the values its first step would
    start from, so that a checkpoint saved before the first step holds the same keys as any
    later one (megatron's dist_checkpointing loads only into matching keys).

    Adam(W): step 0 and zero moments, exactly torch's. SGD with momentum: a zero momentum
    buffer, which its first step turns into the gradient itself (0 * momentum + grad), as torch
    does when it creates the buffer from the first gradient.
    """
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = inner.optimizer
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                state = torch_optimizer.state[param]
                if state:
                    continue
                if isinstance(torch_optimizer, torch.optim.Adam | torch.optim.AdamW):
                    on_device = group.get("capturable") or group.get("fused")
                    state["step"] = torch.zeros(
                        (), dtype=torch.float32, device=param.device if on_device else "cpu"
                    )
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(
                        param, memory_format=torch.preserve_format
                    )
                elif isinstance(torch_optimizer, torch.optim.SGD) and group["momentum"]:
                    assert not group["dampening"], "a zero buffer equals torch's first step only"
                    state["momentum_buffer"] = torch.zeros_like(
                        param, memory_format=torch.preserve_format
                    )
