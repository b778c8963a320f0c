"""Packing parameters into one buffer per dtype keeps their values and their training."""

from __future__ import annotations

import pytest
import torch

from trainer_svc.runtime.param_buffers import pack_parameters, standalone


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 3))
    model[1].to(torch.float64)  # a second dtype: a second buffer
    return model


def _train(model: torch.nn.Module) -> list[torch.Tensor]:
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for seed in range(3):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(seed))
        h = model[1](model[0](x).double()).float()
        model[2](h).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_packed_parameters_share_one_buffer_per_dtype_and_train_identically():
    reference, packed = _model(), _model()
    params = list(packed.parameters())
    ids = [id(p) for p in params]
    assert pack_parameters([*params, params[0]], alignment=64) == 2  # repeats are packed once
    assert [id(p) for p in packed.parameters()] == ids
    storages = {(p.dtype, p.untyped_storage().data_ptr()) for p in params}
    assert len(storages) == 2
    assert all(not standalone(p) and p.data_ptr() % 64 == 0 for p in params)
    for a, b in zip(reference.parameters(), params, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(_train(reference), _train(packed), strict=True):
        assert torch.equal(a, b)
    assert {p.untyped_storage().data_ptr() for p in params if p.dtype == torch.float32} == {
        s for d, s in storages if d == torch.float32
    }


def test_parameters_already_in_a_shared_buffer_stay():
    buffer = torch.zeros(20)
    shared = torch.nn.Parameter(buffer[4:10])
    alone = torch.nn.Parameter(torch.ones(3))
    assert pack_parameters([shared, alone]) == 1
    assert shared.data_ptr() == buffer.data_ptr() + 16
    assert torch.equal(alone, torch.ones(3)) and not standalone(alone)
    with pytest.raises(ValueError, match="power of two"):
        pack_parameters([alone], alignment=24)
