"""ActivationDtypeRMSNorm: the norm of a bf16 model computed with its float32 weight cast to
the activations' dtype (one fused kernel on a GPU), unchanged in float32, the parameter and the
state dict untouched, and its gradient reaching the float32 weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer_svc.runtime import norms


def test_install_swaps_plain_rms_norms_in_place_and_keeps_their_state() -> None:
    model = torch.nn.Sequential(torch.nn.RMSNorm(8, eps=1e-5), torch.nn.Linear(8, 8))
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 1.5)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    weight = model[0].weight
    assert norms.install(model) == 1
    assert type(model[0]) is norms.ActivationDtypeRMSNorm
    assert model[0].weight is weight and weight.dtype == torch.float32
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert norms.install(model) == 0  # already swapped


def test_float32_is_unchanged_and_bf16_uses_the_cast_weight() -> None:
    torch.manual_seed(0)
    plain = torch.nn.RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
    swapped = torch.nn.RMSNorm(64, eps=1e-6)
    swapped.load_state_dict(plain.state_dict())
    norms.install(swapped)
    x = torch.randn(5, 3, 64)
    assert torch.equal(swapped(x), plain(x))
    half = x.bfloat16().requires_grad_()
    out = swapped(half)
    assert out.dtype == torch.bfloat16
    expected = F.rms_norm(half.detach(), (64,), plain.weight.detach().bfloat16(), 1e-6)
    assert torch.equal(out.detach(), expected)
    out.float().sum().backward()
    assert swapped.weight.grad is not None and swapped.weight.grad.dtype == torch.float32
    assert half.grad is not None and torch.isfinite(half.grad).all()
