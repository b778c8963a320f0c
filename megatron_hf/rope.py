"""Rotary position embedding as an HF config asks for it, computed exactly as transformers does.

A scaled RoPE (Llama 3.x `llama3`, `linear`, Qwen's `yarn`) changes only the rotary inverse
frequencies and, for YaRN, a factor on cos and sin; the weights are those of any other model.
The trainer builds megatron's plain RoPE and swaps in `inverse_frequencies`, so its Forward is
transformers' on long-context checkpoints. Every other kind is refused at start: a model
trained with unscaled RoPE would differ silently from the one it is served as.

Torch is imported only by `inverse_frequencies`, so reading a config stays torch-free.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEFAULT_THETA = 10000.0
"""transformers' `default_theta` for Llama, Qwen2 and Qwen3."""


class RopeKind(enum.Enum):
    DEFAULT = "default"
    LINEAR = "linear"
    LLAMA3 = "llama3"
    YARN = "yarn"


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """An HF config's RoPE scaling with the values transformers fills in where it is silent."""

    kind: RopeKind = RopeKind.DEFAULT
    factor: float = 1.0
    """Context extension: linear and llama3 divide (low) frequencies by it, YaRN interpolates."""
    low_freq_factor: float | None = None
    """llama3: wavelengths above original/low_freq_factor are divided by `factor`."""
    high_freq_factor: float | None = None
    """llama3: wavelengths below original/high_freq_factor are kept."""
    original_max_position_embeddings: int | None = None
    """llama3 and yarn: the context length the model was pretrained at."""
    beta_fast: float = 32.0
    """yarn: rotations above which a dimension extrapolates (keeps its frequency)."""
    beta_slow: float = 1.0
    """yarn: rotations below which a dimension interpolates (frequency / factor)."""
    mscale: float | None = None
    """yarn: with `mscale_all_dim`, the numerator of the inferred attention factor."""
    mscale_all_dim: float | None = None
    """yarn: with `mscale`, the denominator of the inferred attention factor."""
    attention_factor: float | None = None
    """yarn: the multiplier on cos and sin; None infers it (`attention_factor()`)."""
    truncate: bool = True
    """yarn: round the interpolation ramp's ends to whole dimensions."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.factor) or self.factor <= 0:
            raise ValueError(f"RoPE factor must be a positive number, got {self.factor}")
        needs = {
            RopeKind.LLAMA3: (
                "low_freq_factor",
                "high_freq_factor",
                "original_max_position_embeddings",
            ),
            RopeKind.YARN: ("original_max_position_embeddings",),
        }.get(self.kind, ())
        absent = [name for name in needs if getattr(self, name) is None]
        if absent:
            raise ValueError(f"{self.kind.value} RoPE needs {absent}")
        original = self.original_max_position_embeddings
        if original is not None and original <= 0:
            raise ValueError(f"original_max_position_embeddings must be positive, got {original}")


def hf_rope_theta(cfg: Mapping[str, Any]) -> float:
    """The RoPE base: transformers prefers the one inside the RoPE dict to a top-level one."""
    _, params = _rope_dict(cfg)
    for theta in (params.get("rope_theta"), cfg.get("rope_theta")):
        if theta is not None:
            return float(theta)
    return DEFAULT_THETA


def hf_rope_scaling(cfg: Mapping[str, Any]) -> RopeScaling:
    """The RoPE scaling of an HF config dict, legacy `rope_scaling` or transformers 5's
    `rope_parameters` (`rope_scaling` wins when both are set, as in transformers), with the
    defaults transformers 5 fills in. Raises ValueError, naming the field and its value, for
    kinds the trainer does not compute and for a partial rotary dimension."""
    source, params = _rope_dict(cfg)
    raw_kind = params.get("rope_type", params.get("type", "default"))
    try:
        kind = RopeKind(raw_kind)
    except ValueError:
        supported = ", ".join(k.value for k in RopeKind)
        raise ValueError(
            f"unsupported {source}.rope_type {raw_kind!r}; supported: {supported}"
        ) from None
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        raise ValueError(
            f"unsupported partial_rotary_factor {partial!r}: the whole head must rotate"
        )
    if kind is RopeKind.DEFAULT:
        return RopeScaling()
    field = _Fields(source, kind, params)
    if kind is RopeKind.LINEAR:
        return RopeScaling(kind=kind, factor=field.required("factor"))
    maximum = cfg.get("max_position_embeddings")
    if not isinstance(maximum, int) or isinstance(maximum, bool) or maximum <= 0:
        raise ValueError(f"{kind.value} RoPE needs a positive max_position_embeddings: {maximum!r}")
    # transformers lets a top-level original_max_position_embeddings override the dict's.
    original = cfg.get("original_max_position_embeddings")
    if original is None:
        original = params.get("original_max_position_embeddings", maximum)
    if not isinstance(original, int) or isinstance(original, bool):
        raise ValueError(f"{source}.original_max_position_embeddings must be an int: {original!r}")
    if kind is RopeKind.LLAMA3:
        return RopeScaling(
            kind=kind,
            factor=field.required("factor"),
            low_freq_factor=field.required("low_freq_factor"),
            high_freq_factor=field.required("high_freq_factor"),
            original_max_position_embeddings=original,
        )
    field.present("factor")  # transformers refuses a YaRN dict without it, but takes null
    factor = field.optional("factor")
    if factor is None:  # the extension the config's lengths imply
        factor = maximum / original
    truncate = params.get("truncate", True)
    if truncate is not None and not isinstance(truncate, bool):
        raise ValueError(f"{source}.truncate must be a boolean, got {truncate!r}")
    return RopeScaling(
        kind=kind,
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=field.optional("beta_fast") or 32.0,
        beta_slow=field.optional("beta_slow") or 1.0,
        mscale=field.optional("mscale"),
        mscale_all_dim=field.optional("mscale_all_dim"),
        attention_factor=field.optional("attention_factor"),
        truncate=bool(truncate),
    )


def hf_rope_scaling_dict(scaling: RopeScaling) -> dict[str, Any] | None:
    """`scaling` as a legacy `rope_scaling` entry of config.json (None when unscaled), every
    default written out, so transformers and vLLM compute the same as `hf_rope_scaling` read."""
    if scaling.kind is RopeKind.DEFAULT:
        return None
    out: dict[str, Any] = {"rope_type": scaling.kind.value, "factor": scaling.factor}
    if scaling.kind is RopeKind.LLAMA3:
        out["low_freq_factor"] = scaling.low_freq_factor
        out["high_freq_factor"] = scaling.high_freq_factor
    if scaling.kind is not RopeKind.LINEAR:
        out["original_max_position_embeddings"] = scaling.original_max_position_embeddings
    if scaling.kind is RopeKind.YARN:
        out |= {"beta_fast": scaling.beta_fast, "beta_slow": scaling.beta_slow}
        out["truncate"] = scaling.truncate
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(scaling, name) is not None:
                out[name] = getattr(scaling, name)
    return out


def attention_factor(scaling: RopeScaling) -> float:
    """What transformers multiplies cos and sin by: 1 but for YaRN, whose `0.1 ln(s) + 1`
    (or a ratio of two such terms, DeepSeek's mscale) keeps attention entropy at long range."""
    if scaling.kind is not RopeKind.YARN:
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return _yarn_mscale(scaling.factor, scaling.mscale) / _yarn_mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    return _yarn_mscale(scaling.factor, 1.0)


def inverse_frequencies(scaling: RopeScaling, head_dim: int, theta: float) -> torch.Tensor:
    """The [head_dim / 2] fp32 rotary inverse frequencies, bit for bit transformers' own: the
    same operations in the same order and dtypes, on the CPU as transformers computes them."""
    import torch

    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    if scaling.kind is RopeKind.YARN:
        return _yarn_inverse_frequencies(scaling, theta**exponents, head_dim, theta)
    unscaled = 1.0 / (theta**exponents)
    if scaling.kind is RopeKind.LINEAR:
        return unscaled / scaling.factor
    if scaling.kind is RopeKind.LLAMA3:
        return _llama3_inverse_frequencies(scaling, unscaled)
    return unscaled


def _llama3_inverse_frequencies(scaling: RopeScaling, unscaled: torch.Tensor) -> torch.Tensor:
    """Long wavelengths divided by the factor, short ones kept, a linear blend between."""
    import torch

    assert scaling.low_freq_factor is not None and scaling.high_freq_factor is not None
    assert scaling.original_max_position_embeddings is not None
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    original, factor = scaling.original_max_position_embeddings, scaling.factor
    wavelength = 2 * math.pi / unscaled
    longest_kept, shortest_divided = original / high, original / low
    divided = torch.where(wavelength > shortest_divided, unscaled / factor, unscaled)
    blend = (original / wavelength - low) / (high - low)
    blended = (1 - blend) * divided / factor + blend * divided
    between = ~(wavelength < longest_kept) * ~(wavelength > shortest_divided)
    return torch.where(between, blended, divided)


def _yarn_inverse_frequencies(
    scaling: RopeScaling, powers: torch.Tensor, head_dim: int, theta: float
) -> torch.Tensor:
    """Dimensions that turn fewer than beta_slow times over the original context interpolate
    (frequency / factor), those turning more than beta_fast times keep their frequency, and a
    linear ramp over dimension index joins them."""
    import torch

    assert scaling.original_max_position_embeddings is not None
    original = scaling.original_max_position_embeddings

    def dimension_turning(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    first, last = dimension_turning(scaling.beta_fast), dimension_turning(scaling.beta_slow)
    if scaling.truncate:
        first, last = math.floor(first), math.ceil(last)
    first, last = max(first, 0), min(last, head_dim - 1)
    if first == last:
        last += 0.001
    ramp = torch.clamp(
        (torch.arange(head_dim // 2, dtype=torch.float32) - first) / (last - first), 0, 1
    )
    kept_share = 1 - ramp
    kept = 1.0 / powers
    interpolated = 1.0 / (scaling.factor * powers)
    return interpolated * (1 - kept_share) + kept * kept_share


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_dict(cfg: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """(field name, dict): transformers reads `rope_scaling` when it is set, else
    `rope_parameters`; a dict per layer type (interleaved attention) is not supported."""
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.get(key)
        if not value:
            continue
        if not isinstance(value, Mapping) or any(isinstance(v, Mapping) for v in value.values()):
            raise ValueError(f"unsupported {key}={value!r}: expected one flat dict")
        return key, value
    return "rope_parameters", {}


@dataclass(frozen=True)
class _Fields:
    """Reads numbers from one RoPE dict, naming the field in every refusal."""

    source: str
    kind: RopeKind
    params: Mapping[str, Any]

    def present(self, name: str) -> None:
        if name not in self.params:
            raise ValueError(f"{self.source} with rope_type {self.kind.value!r} lacks {name}")

    def required(self, name: str) -> float:
        self.present(name)
        return self._checked(name, self.params[name])

    def optional(self, name: str) -> float | None:
        value = self.params.get(name)
        return None if value is None else self._checked(name, value)

    def _checked(self, name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{self.source}.{name} must be a number, got {value!r}")
        return float(value)
