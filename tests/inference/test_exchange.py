"""`exchange.Exchange`: staged slices exchanged with an engine's tensors in staging order as the
pull's prefix becomes final, waited for, and taken back whole; which tensors qualify. On the
CPU here (three copies per exchange); tests/gpu runs the Triton kernel behind a running check."""

from __future__ import annotations

import torch

from inference_ext.exchange import Exchange, exchangeable


def _staged(
    sizes: list[int], device: str = "cpu"
) -> tuple[torch.Tensor, list[tuple[str, int, torch.Tensor]]]:
    """A staging buffer holding bf16 slices of `sizes` elements back to back, numbered t0, t1…"""
    total = 2 * sum(sizes)
    buffer = torch.arange(total, dtype=torch.int32).to(torch.uint8).to(device)
    slices, offset = [], 0
    for i, n in enumerate(sizes):
        view = buffer[offset : offset + 2 * n].view(torch.bfloat16)
        offset += 2 * n
        slices.append((f"t{i}", offset, view))
    return buffer, slices


def test_slices_are_exchanged_in_staging_order_as_their_prefix_is_final(
    device: str = "cpu",
) -> None:
    buffer, slices = _staged([8, 4, 16], device)
    new = {name: view.clone() for name, _, view in slices}
    engine = {name: torch.full_like(view, float(i)) for i, (name, _, view) in enumerate(slices)}
    old = {name: t.clone() for name, t in engine.items()}
    exchange = Exchange.of(reversed(slices), engine)  # sorted by where they end
    assert [s.name for s in exchange.swaps] == ["t0", "t1", "t2"]
    assert exchange.nbytes == buffer.numel() and exchange.names == {"t0", "t1", "t2"}

    exchange.upto(slices[1][1] - 1)  # t1 not whole yet
    assert exchange.exchanged == 1
    assert torch.equal(engine["t0"], new["t0"]) and torch.equal(slices[0][2], old["t0"])
    assert torch.equal(engine["t1"], old["t1"])
    exchange.upto(slices[1][1] - 1)  # the same prefix again queues nothing
    assert exchange.exchanged == 1
    exchange.upto(buffer.numel())
    exchange.wait()
    assert exchange.exchanged == 3
    for name, _, view in slices:
        assert torch.equal(engine[name], new[name]) and torch.equal(view, old[name])


def test_undo_takes_back_every_exchange_queued(device: str = "cpu") -> None:
    _, slices = _staged([8, 4, 16], device)
    new = {name: view.clone() for name, _, view in slices}
    engine = {name: torch.full_like(view, -1.0) for name, _, view in slices}
    old = {name: t.clone() for name, t in engine.items()}
    exchange = Exchange.of(slices, engine)
    exchange.upto(slices[1][1])
    exchange.undo()
    assert exchange.exchanged == 0
    for name, _, view in slices:
        assert torch.equal(engine[name], old[name]) and torch.equal(view, new[name])
    exchange.undo()  # nothing queued: nothing changes
    assert all(torch.equal(engine[n], old[n]) for n in engine)


def test_only_tensors_held_as_staged_are_exchanged() -> None:
    _, slices = _staged([8, 4, 16, 6])
    (_, _, a), (_, _, b), (_, _, c), (_, _, d) = slices
    assert exchangeable(a, torch.zeros_like(a))
    assert not exchangeable(a, None)
    assert not exchangeable(a, torch.zeros(8, dtype=torch.float32))  # the engine casts
    assert not exchangeable(c, torch.zeros(4, 4, dtype=torch.bfloat16))  # another shape
    assert not exchangeable(d.view(2, 3), torch.zeros(3, 2, dtype=torch.bfloat16).t())
    assert not exchangeable(a, a)  # the same bytes
    engine = {"t0": torch.zeros_like(a), "t1": torch.zeros(4), "t3": torch.zeros_like(d)}
    exchange = Exchange.of(slices, engine)
    assert exchange.names == {"t0", "t3"}  # t1 is cast by the installer, t2 not handed over
    assert exchange.nbytes == a.nbytes + d.nbytes
    assert not exchangeable(b, torch.zeros(4))


def test_no_tensors_no_exchanges() -> None:
    exchange = Exchange.of([], {})
    exchange.upto(1 << 30)
    exchange.wait()
    exchange.undo()
    assert exchange.exchanged == 0 and exchange.nbytes == 0 and not exchange.names
