"""`--busy-poll`: the sidecar's event loop keeps turning while a call waits for a version, and
only then; the waiting call is answered as without it. In-process (the servicer without
gRPC): the loop's sleeps are what the option removes."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.sidecar_control import Config, publish_request, trainer_part
from refit_sidecar.cli import parse_config
from refit_sidecar.registry import Registry, RegistryConfig
from refit_sidecar.server import RefitServicer
from trainer_refit.v1 import common_pb2
from trainer_refit.v1 import refit_pb2 as pb

_SHAPES = Config(
    layers=1,
    hidden=64,
    receivers=1,
    max_children=1,
    direct=True,
    slots=2,
    warmup=0,
    versions=1,
    timeout=10.0,
    out=None,
)


async def _waited_lease(busy_poll: bool) -> tuple[list[bool], bool, pb.Lease]:
    """A lease asked for version 1 before it is published: whether the loop was kept turning
    while the call waited (sampled), after it was answered, and the lease."""
    servicer = RefitServicer(Registry(RegistryConfig()), busy_poll=busy_poll)
    layout = common_pb2.ParallelLayout(tensor_parallel=1, world_size=1)
    await servicer.RegisterTrainer(pb.RegisterTrainerRequest(layout=layout, num_slots=2), None)
    await servicer.ReserveSlot(pb.ReserveSlotRequest(version=1), None)
    asked = pb.AcquireLeaseRequest(version=1, receiver_id="r", ttl_seconds=10, wait_seconds=10)
    lease = asyncio.ensure_future(servicer.AcquireLease(asked, None))
    samples = []
    for _ in range(5):
        await asyncio.sleep(0.005)
        samples.append(servicer.spinning)
    assert not lease.done()
    report = publish_request(1, 0, trainer_part(_SHAPES, 1, "trainer-rank0"))
    await servicer.PublishShards(report, None)
    granted = await asyncio.wait_for(lease, 5)
    for _ in range(3):
        await asyncio.sleep(0)
    return samples, servicer.spinning, granted


@pytest.mark.parametrize("busy_poll", [True, False])
def test_the_loop_turns_while_a_call_waits_for_its_version_and_only_then(busy_poll: bool) -> None:
    samples, after, lease = asyncio.run(_waited_lease(busy_poll))
    assert samples == [busy_poll] * 5
    assert not after  # no call waits: the loop sleeps again
    assert (lease.version, lease.receiver_id) == (1, "r") and lease.lease_id


def test_busy_polling_is_off_unless_asked_for() -> None:
    assert not parse_config(["--insecure"])[0].busy_poll
    assert parse_config(["--insecure", "--busy-poll"])[0].busy_poll
