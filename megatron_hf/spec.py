"""Model shape facts shared by the Megatron and HF sides, read from an HF config."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_hf.rope import RopeScaling, hf_rope_scaling, hf_rope_scaling_dict, hf_rope_theta


class ModelFamily(enum.Enum):
    LLAMA = "llama"
    QWEN2 = "qwen2"
    QWEN3 = "qwen3"
    MISTRAL = "mistral"
    """Llama's layout under its own class name; accepted without a sliding window only."""
    QWEN3_MOE = "qwen3_moe"
    """Qwen3's attention with a routed mixture of experts in every layer (no shared expert)."""
    MIXTRAL = "mixtral"
    """Mistral's attention (full, no sliding window) with top-k experts in every layer."""


# HF causal-LM class per family (the only architecture accepted for that family).
ARCHITECTURES: Mapping[ModelFamily, str] = {
    ModelFamily.LLAMA: "LlamaForCausalLM",
    ModelFamily.QWEN2: "Qwen2ForCausalLM",
    ModelFamily.QWEN3: "Qwen3ForCausalLM",
    ModelFamily.MISTRAL: "MistralForCausalLM",
    ModelFamily.QWEN3_MOE: "Qwen3MoeForCausalLM",
    ModelFamily.MIXTRAL: "MixtralForCausalLM",
}

MOE_FAMILIES = frozenset({ModelFamily.QWEN3_MOE, ModelFamily.MIXTRAL})
"""Families whose MLP is a routed mixture of experts (`ModelSpec.moe` set)."""


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    """The routed experts of every layer: a top-k softmax router over `num_experts` SwiGLU
    experts of width `ffn_hidden_size`, no shared expert."""

    num_experts: int
    top_k: int
    """Experts each token is routed to (HF `num_experts_per_tok`)."""
    ffn_hidden_size: int
    """Each expert's intermediate size (HF `moe_intermediate_size`)."""
    norm_topk_prob: bool
    """True: the chosen experts' probabilities are renormalised to sum to 1 (a softmax over
    the top-k logits); False: they keep their share of the softmax over every expert."""

    def __post_init__(self) -> None:
        if self.num_experts <= 0 or self.ffn_hidden_size <= 0:
            raise ValueError(
                f"num_experts ({self.num_experts}) and the expert width "
                f"({self.ffn_hidden_size}) must be positive"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"top_k must lie in [1, num_experts={self.num_experts}], got {self.top_k}"
            )


_REQUIRED_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_hidden_layers",
    "vocab_size",
    "max_position_embeddings",
)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    family: ModelFamily
    architecture: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    """Number of key/value heads (HF `num_key_value_heads`)."""
    head_dim: int
    """May differ from hidden_size // num_attention_heads (Qwen3)."""
    vocab_size: int
    """HF vocabulary size, without Megatron's padding."""
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    """How the rotary frequencies are scaled for a longer context; default: unscaled."""
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_layernorm: bool
    pad_token_id: int | None = None
    """The embedding row HF never trains (`padding_row`), in [0, vocab_size); None: none."""
    moe: MoESpec | None = None
    """The routed experts that replace every layer's MLP; None: a dense model."""

    def __post_init__(self) -> None:
        positive = {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "ffn_hidden_size": self.ffn_hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_query_groups": self.num_query_groups,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
        }
        for field_name, value in positive.items():
            if value <= 0:
                raise ValueError(f"ModelSpec.{field_name} must be positive, got {value}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_query_groups ({self.num_query_groups})"
            )
        expected = ARCHITECTURES[self.family]
        if self.architecture != expected:
            raise ValueError(
                f"architecture {self.architecture!r} does not match family "
                f"{self.family.value!r}; expected {expected!r}"
            )
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError("rope_theta and rms_norm_eps must be positive")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"pad_token_id must lie in [0, {self.vocab_size}), got {self.pad_token_id}"
            )
        if (self.moe is not None) != (self.family in MOE_FAMILIES):
            raise ValueError(
                f"family {self.family.value!r} "
                + ("needs" if self.family in MOE_FAMILIES else "has no")
                + " mixture-of-experts settings"
            )

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def qkv_rows(self) -> int:
        """Rows of Megatron's fused linear_qkv: groups x (heads/groups + 2) x head_dim."""
        return self.num_query_groups * (self.heads_per_group + 2) * self.head_dim

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelSpec:
        """Accepts a transformers PretrainedConfig or a config.json dict."""
        cfg: dict[str, Any] = dict(config if isinstance(config, Mapping) else config.to_dict())
        model_type = cfg.get("model_type")
        try:
            family = ModelFamily(model_type)
        except ValueError:
            supported = ", ".join(f.value for f in ModelFamily)
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {supported}"
            ) from None
        _reject_unsupported_features(cfg, family)
        architectures = cfg.get("architectures") or [ARCHITECTURES[family]]
        if len(architectures) != 1:
            raise ValueError(f"expected exactly one HF architecture, got {architectures}")
        absent = [k for k in _REQUIRED_KEYS if k not in cfg]
        if absent:
            raise ValueError(f"HF config for {model_type!r} lacks required keys {absent}")
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        return cls(
            family=family,
            architecture=architectures[0],
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            ffn_hidden_size=int(cfg["intermediate_size"]),
            num_attention_heads=heads,
            num_query_groups=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            rope_theta=hf_rope_theta(cfg),
            rope_scaling=hf_rope_scaling(cfg),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family is ModelFamily.QWEN2,  # Qwen2 q/k/v always carry a bias.
            qk_layernorm=family in (ModelFamily.QWEN3, ModelFamily.QWEN3_MOE),
            pad_token_id=padding_row(cfg.get("pad_token_id"), int(cfg["vocab_size"])),
            moe=_hf_moe(cfg, family) if family in MOE_FAMILIES else None,
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> ModelSpec:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ValueError(f"no config.json in {path}; expected an HF checkpoint directory")
        return cls.from_hf_config(json.loads(config_path.read_text()))

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json dict for this spec (used when exporting without a source config)."""
        cfg: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.family.value,
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.ffn_hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_query_groups,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            # The legacy form: transformers 5 and vLLM read it (as rope_parameters).
            "rope_scaling": hf_rope_scaling_dict(self.rope_scaling),
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
        }
        if self.pad_token_id is not None:
            cfg["pad_token_id"] = self.pad_token_id
        if self.family is ModelFamily.MIXTRAL:
            assert self.moe is not None and self.moe.norm_topk_prob
            cfg.update(
                num_local_experts=self.moe.num_experts,
                num_experts_per_tok=self.moe.top_k,
                intermediate_size=self.moe.ffn_hidden_size,
                sliding_window=None,
                router_jitter_noise=0.0,
            )
        elif self.moe is not None:
            cfg.update(
                num_experts=self.moe.num_experts,
                num_experts_per_tok=self.moe.top_k,
                moe_intermediate_size=self.moe.ffn_hidden_size,
                norm_topk_prob=self.moe.norm_topk_prob,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            )
        if self.family is ModelFamily.MISTRAL:
            # MistralConfig's default is a 4096-token window: say "none" explicitly.
            cfg["sliding_window"] = None
        if self.family is ModelFamily.QWEN2:
            if self.head_dim * self.num_attention_heads != self.hidden_size:
                raise ValueError("Qwen2 requires head_dim == hidden_size // num_attention_heads")
            del cfg["head_dim"]
        return cfg


def padded_vocab_size(vocab_size: int, tensor_parallel: int, multiple: int = 128) -> int:
    """Megatron's padded vocab: smallest multiple of `multiple * tensor_parallel` >= vocab_size."""
    if vocab_size <= 0 or tensor_parallel <= 0 or multiple <= 0:
        raise ValueError(
            f"vocab_size, tensor_parallel and multiple must be positive, got "
            f"{vocab_size}, {tensor_parallel}, {multiple}"
        )
    step = multiple * tensor_parallel
    return -(-vocab_size // step) * step


def padding_row(pad_token_id: Any, vocab_size: int) -> int | None:
    """The embedding row that HF's Llama, Qwen2 and Qwen3 never train: they build their
    embedding as `nn.Embedding(vocab_size, hidden, padding_idx=pad_token_id)`, whose lookup
    passes the row on but gives it no gradient. A negative id counts from the end, as
    nn.Embedding counts it; HF cannot build a model whose id lies outside the vocabulary, so
    there is no behaviour to follow and no row is frozen."""
    if pad_token_id is None or isinstance(pad_token_id, bool):
        return None
    row = int(pad_token_id)
    if not -vocab_size <= row < vocab_size:
        return None
    return row % vocab_size


def _hf_moe(cfg: Mapping[str, Any], family: ModelFamily) -> MoESpec:
    """The experts of a Qwen3-MoE or Mixtral config. transformers 5 calls Qwen3-MoE's expert
    count `num_local_experts` where the published configs say `num_experts`; both are read.
    Mixtral's experts are `intermediate_size` wide and always renormalise their top-k."""
    mixtral = family is ModelFamily.MIXTRAL
    experts = cfg.get("num_local_experts") if mixtral else cfg.get("num_experts")
    if experts is None and not mixtral:
        experts = cfg.get("num_local_experts")
    width_key = "intermediate_size" if mixtral else "moe_intermediate_size"
    absent = [
        key
        for key, value in (
            ("num_local_experts" if mixtral else "num_experts", experts),
            ("num_experts_per_tok", cfg.get("num_experts_per_tok")),
            (width_key, cfg.get(width_key)),
        )
        if value is None
    ]
    if absent or experts is None:
        raise ValueError(f"mixture-of-experts config lacks required keys {absent}")
    return MoESpec(
        num_experts=int(experts),
        top_k=int(cfg["num_experts_per_tok"]),
        ffn_hidden_size=int(cfg[width_key]),
        norm_topk_prob=True if mixtral else bool(cfg.get("norm_topk_prob", False)),
    )


def _reject_dense_layers(cfg: Mapping[str, Any]) -> None:
    """Every layer must be an expert layer: dense MLP layers mixed in (`mlp_only_layers`, a
    `decoder_sparse_step` above 1) would need a second layer spec."""
    dense = list(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    if dense or step != 1:
        raise ValueError(
            f"unsupported dense layers among the expert layers (mlp_only_layers={dense}, "
            f"decoder_sparse_step={step}): every layer must route to experts "
            "(mlp_only_layers [] and decoder_sparse_step 1)"
        )
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError("unsupported shared expert (shared_expert_intermediate_size)")


def _reject_unsupported_features(cfg: Mapping[str, Any], family: ModelFamily) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}: only 'silu' (SwiGLU) is supported")
    if cfg.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias=True: MLP projections must have no bias")
    if family is not ModelFamily.QWEN2 and cfg.get("attention_bias"):
        raise ValueError(
            f"unsupported attention_bias=True for {family.value}: it adds an o_proj bias"
        )
    if cfg.get("use_sliding_window"):
        raise ValueError("unsupported use_sliding_window=True: only full attention is supported")
    if family is ModelFamily.MISTRAL:
        # MistralConfig reads an absent key as a 4096-token window, so only an explicit null
        # means full attention; vLLM's Mistral class adds Llama-4 attention scaling and an
        # adaptive norm when their keys are present.
        window = cfg.get("sliding_window", 4096)
        if window is not None:
            raise ValueError(
                f"unsupported sliding_window={window!r} for mistral "
                "(absent means 4096): only full attention (sliding_window null) is supported"
            )
        for key in ("llama_4_scaling", "ada_rms_norm_t_cond"):
            if cfg.get(key):
                raise ValueError(f"unsupported {key}={cfg[key]!r} for mistral")
    if family is ModelFamily.MIXTRAL:
        if cfg.get("sliding_window") is not None:
            raise ValueError(
                f"unsupported sliding_window={cfg['sliding_window']!r} for mixtral: only full "
                "attention (sliding_window null) is supported"
            )
        if cfg.get("router_jitter_noise"):
            raise ValueError(
                f"unsupported router_jitter_noise={cfg['router_jitter_noise']!r}: routing "
                "must not be noised in training"
            )
    if family in MOE_FAMILIES:
        _reject_dense_layers(cfg)
    layer_types = cfg.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"unsupported layer_types {sorted(set(layer_types))}: full attention only")
