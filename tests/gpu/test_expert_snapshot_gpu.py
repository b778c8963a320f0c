"""A snapshot of a mixture of experts' grouped tensors on a GPU: Megatron's DDP buffer holds a
layer's experts last first with fc1 and fc2 interleaved, so a grouped tensor's members are one
region each in the slot, and a piece's regions go out as one `_foreach_copy_`. This checks
the slot holds each grouped tensor in expert order and prints the copy's time beside one
device-local copy of the same bytes. Run on a lent GPU machine:

    python -m pytest -m gpu tests/gpu/test_expert_snapshot_gpu.py -s
"""

from __future__ import annotations

import pytest
import torch

from refit_sidecar.core.manifest import DType
from refit_sidecar.publish.shard_specs import expert_group_spec
from refit_sidecar.publish.slot_layout import DEFAULT_FIRST_PIECE_BYTES, cut_into_pieces, piece_ends
from tests.support.cuda_timing import median_ms
from trainer_svc.runtime.snapshot_slot import (
    FOREACH_FROM,
    PublishedTensor,
    copy_piece,
    parameter_layout,
    piece_copies,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LAYERS, EXPERTS, HIDDEN, WIDTH = 8, 16, 2048, 768
"""Qwen3-30B-A3B's expert shape (hidden 2048, expert width 768), 16 experts a rank (EP=8 of
128), 8 layers: 256 regions, 1.2 GB in bf16."""


def test_grouped_experts_snapshot_in_expert_order_and_its_copy_time() -> None:
    fc1, fc2 = (2 * WIDTH, HIDDEN), (HIDDEN, WIDTH)
    per_expert = fc1[0] * fc1[1] + fc2[0] * fc2[1]
    buffer = torch.randn(LAYERS * EXPERTS * per_expert, device="cuda").to(torch.bfloat16)
    tensors, at = [], 0
    for layer in range(LAYERS):
        members: dict[int, list[torch.nn.Parameter]] = {1: [], 2: []}
        for _ in range(EXPERTS):  # last expert first, fc2 before fc1, as megatron's buffer
            for fc, shape in ((2, fc2), (1, fc1)):
                size = shape[0] * shape[1]
                members[fc].insert(0, torch.nn.Parameter(buffer[at : at + size].view(shape)))
                at += size
        for fc, shape in ((1, fc1), (2, fc2)):
            spec = expert_group_spec(
                f"decoder.layers.{layer}.mlp.experts.linear_fc{fc}.weight",
                (EXPERTS, *shape),
                DType.BFLOAT16,
                fc=fc,
                ep_rank=0,
                ep_size=1,
                etp_rank=0,
                etp_size=1,
            )
            tensors.append(PublishedTensor(spec, tuple(members[fc])))
    layout, holders = parameter_layout(tensors, 256)
    storage = next(iter(holders.values())).untyped_storage()
    arena = torch.empty(layout.nbytes, dtype=torch.uint8, device="cuda")
    source = torch.empty(0, dtype=torch.uint8, device="cuda").set_(storage)
    pieces = [
        piece_copies(
            [arena[p.offset : p.offset + p.nbytes] for p in parts],
            [source[p.start : p.stop] for p in parts],
        )
        for parts in cut_into_pieces(
            layout.regions, piece_ends(layout.nbytes, DEFAULT_FIRST_PIECE_BYTES)
        )
    ]

    def snapshot() -> None:
        for destinations, sources in pieces:
            copy_piece(destinations, sources, non_blocking=True)

    snapshot()
    torch.cuda.synchronize()
    for tensor in tensors:
        offset = layout.offsets[tensor.name]
        size = tensor.spec.nbytes
        held = arena[offset : offset + size].view(torch.bfloat16).view(tensor.spec.local_shape)
        assert torch.equal(held, torch.stack([m.data for m in tensor.members]))
    flat = source[: buffer.numel() * 2]
    target = arena[: flat.numel()]
    as_bytes = [
        ([d.view(torch.uint8) for d in ds], [x.view(torch.uint8) for x in xs]) for ds, xs in pieces
    ]

    def snapshot_bytes() -> None:
        for destinations, sources in as_bytes:
            torch._foreach_copy_(destinations, sources, non_blocking=True)

    grouped = median_ms(snapshot, warmup=0, iterations=20)
    grouped_bytes = median_ms(snapshot_bytes, warmup=0, iterations=20)
    plain = median_ms(lambda: target.copy_(flat, non_blocking=True), warmup=0, iterations=20)
    regions = len(layout.regions)
    print(
        f"{regions} expert regions, {flat.numel() / 1e9:.2f} GB in {len(pieces)} pieces: "
        f"snapshot {grouped:.3f} ms (of bytes {grouped_bytes:.3f} ms), "
        f"one device-local copy of the same bytes {plain:.3f} ms ({grouped / plain:.2f}x); "
        f"{torch.cuda.get_device_name()}"
    )
    assert all(ds[0].dtype == torch.int64 for ds, _ in pieces if len(ds) >= FOREACH_FROM)
    assert regions == 2 * LAYERS * EXPERTS
