"""`Staging.view`: a receiver hands its installer the same typed views of staging at every
refit of a layout, and new ones once staging regrows (the old views would keep the old buffer
alive). Refits through these views are checked bit for bit by the fan-out and vLLM tests;
here a recording stand-in for the transport pins down when the buffer is registered."""

from __future__ import annotations

import torch

from inference_ext.receiver import Staging
from refit_sidecar.memory.region import Region


class _Registrations:
    def __init__(self) -> None:
        self.live: list[Region] = []

    def register(self, region: Region) -> None:
        self.live.append(region)

    def deregister(self, region: Region) -> None:
        self.live.remove(region)


def test_staging_hands_out_the_same_views_until_it_regrows() -> None:
    registrations = _Registrations()
    staging = Staging(registrations, torch.device("cpu"))  # type: ignore[arg-type]
    staging.ensure(64)
    view = staging.view(8, torch.float32, (2, 2))
    assert staging.view(8, torch.float32, (2, 2)) is view
    assert staging.view(8, torch.bfloat16, (2, 2)) is not view
    # A view, not a copy: the next version's bytes show through it.
    staging.buffer[8:24].view(torch.float32).copy_(torch.arange(4.0))
    assert view.tolist() == [[0.0, 1.0], [2.0, 3.0]]
    staging.ensure(32)  # fits: same buffer, same views
    assert staging.view(8, torch.float32, (2, 2)) is view
    staging.ensure(128)  # regrown: a new buffer, registered instead of the old one
    regrown = staging.view(8, torch.float32, (2, 2))
    assert regrown is not view
    assert regrown.data_ptr() == staging.buffer.data_ptr() + 8
    assert len(registrations.live) == 1 and registrations.live[0].nbytes == 128
    staging.release()
    assert not registrations.live
    assert staging.view(8, torch.float32, (2, 2)) is not regrown
