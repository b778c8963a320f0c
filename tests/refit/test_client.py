"""SidecarClient end to end: a real `python -m refit_sidecar` process, a NIXL source process
(two ranks, one agent each) publishing version 1 through the client, and this process reading
the manifest through the client and pulling every tensor bit-exact over NIXL."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import pytest

from refit_sidecar.core.manifest import DType, Manifest, merge_manifests
from refit_sidecar.core.plan import plan_pull, whole
from refit_sidecar.memory.region import Region
from refit_sidecar.publish.shard_source import ShardSource, SourceConfig
from refit_sidecar.publish.shard_specs import ShardSpec, split_pieces
from refit_sidecar.pull.nixl_transport import NixlConfig, NixlTransport
from refit_sidecar.service.client import (
    Lease,
    SlotsExhausted,
    TrainerLayout,
    UnknownLease,
    UnknownVersion,
)
from tests.refit.shards import index, random_global, shard_of
from tests.support.isolation import in_child_process
from tests.support.sidecar import Sidecar, running_sidecar
from trainer_refit.auth import Role

SEED = 3
# name: (global shape, dtype, split dim (None: replicated), blocks along it)
TENSORS: dict[str, tuple[tuple[int, ...], DType, int | None, int]] = {
    "decoder.layers.0.mlp.linear_fc1.weight": ((64, 24), DType.FLOAT32, 0, 2),
    "decoder.layers.0.mlp.linear_fc2.weight": ((24, 32), DType.BFLOAT16, 1, 1),
    "embedding.word_embeddings.weight": ((128, 24), DType.FLOAT16, 0, 1),
    "decoder.layers.0.input_layernorm.weight": ((24,), DType.FLOAT32, None, 1),
}


def _specs(rank: int, size: int) -> list[ShardSpec]:
    specs = []
    for name, (shape, dtype, dim, parts) in TENSORS.items():
        local_shape, pieces = split_pieces(shape, dim, parts, rank, size)
        specs.append(ShardSpec(name, shape, dtype, local_shape, pieces))
    return specs


def publisher(
    conn: Connection, sidecar: Sidecar, ranks: list[tuple[SourceConfig, list[ShardSpec]]]
) -> None:
    """The source process: fills each rank's shards, publishes version 1 through the client,
    reports (slot, retired version, visible per rank, the rank manifests) and then keeps the
    buffers registered until told to stop."""
    sources = [ShardSource.create(config, specs) for config, specs in ranks]
    try:
        for source, (_, specs) in zip(sources, ranks, strict=True):
            for spec in specs:
                full = random_global(spec.parameter, spec.shape, spec.dtype, SEED)
                source.write(spec.parameter, shard_of(full, spec))
        partials = [source.manifest(1) for source in sources]
        with sidecar.client(Role.TRAINER, timeout=30) as client:
            client.wait_ready()
            client.register_trainer(
                TrainerLayout(tensor_parallel=len(ranks)), num_slots=1, owner="test"
            )
            slot, retired = client.reserve_slot(1)
            visible = [
                client.publish(1, source.config.rank, partial)
                for source, partial in zip(sources, partials, strict=True)
            ]
    except Exception as error:
        conn.send(f"publisher failed: {error!r}")
        raise
    conn.send((slot, retired, visible, partials, client.generation))
    with contextlib.suppress(EOFError):
        conn.recv()
    for source in sources:
        source.close()


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    with running_sidecar(tmp_path, "--when-all-slots-leased", "fail") as running:
        yield running


@in_child_process
def test_publish_then_pull_through_the_client(sidecar: Sidecar) -> None:
    with (
        sidecar.client(Role.RECEIVER, timeout=30) as client,
        sidecar.client(Role.TRAINER, timeout=30) as trainer,
    ):
        client.wait_ready(timeout=30)
        assert client.latest_version() is None
        with pytest.raises(UnknownVersion):
            client.manifest(1)

        ranks = [
            (SourceConfig(name=f"client-tp{r}", rank=r, tensor_rank=r), _specs(r, 2))
            for r in range(2)
        ]
        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe()
        process = ctx.Process(target=publisher, args=(child, sidecar, ranks), daemon=True)
        process.start()
        child.close()
        transport = NixlTransport.create(NixlConfig(name="client-puller", pull_timeout_s=60))
        try:
            assert conn.poll(60), "the source process did not publish"
            published = conn.recv()
            assert not isinstance(published, str), published
            slot, retired, visible, partials, generation = published
            assert (slot, retired, visible) == (0, None, [False, True])
            trainer.generation = generation  # the registration the publisher made

            assert client.latest_version() == 1
            watch = client.watch(0)
            assert next(watch) == 1
            watch.close()
            manifest = client.manifest(1)
            expected = merge_manifests(partials)
            by_name = tuple(sorted(expected.parameters, key=lambda p: p.name))
            assert manifest == Manifest(1, by_name, dict(expected.agents))
            assert [p.name for p in manifest.parameters] == sorted(TENSORS)
            assert list(manifest.agents) == ["client-tp0", "client-tp1"]

            lease = client.acquire_lease(1, "test-receiver", ttl=30)
            assert isinstance(lease, Lease) and lease.version == 1
            assert lease.receiver_id == "test-receiver"
            assert 0 < lease.expires_in_seconds <= 30
            plan = plan_pull(manifest, whole(manifest))
            dest = np.zeros(plan.nbytes, np.uint8)
            stats = transport.pull(plan, Region.of_array(dest), verify=True)
            assert stats.verified_shards == len(plan.reads) > 0
            for t in plan.targets:
                shape, dtype, _, _ = TENSORS[t.name]
                truth = random_global(t.name, shape, dtype, SEED)[index(t.box)]
                assert dest[t.span].tobytes() == truth.tobytes(), t

            renewed = client.renew_lease(lease, ttl=60)
            assert renewed.lease_id == lease.lease_id and renewed.expires_in_seconds > 30
            with pytest.raises(SlotsExhausted):
                trainer.reserve_slot(2)  # the only slot holds leased version 1
            client.release_lease(lease)
            with pytest.raises(UnknownLease):
                client.release_lease(lease)
            with pytest.raises(UnknownLease):
                client.renew_lease(Lease("lease-nobody", 1, 0.0, receiver_id="r"), ttl=1)
            with pytest.raises(UnknownVersion):
                client.manifest(99)
            with pytest.raises(UnknownVersion):
                client.acquire_lease(99, "test-receiver", ttl=1)
            with pytest.raises(ValueError):
                client.acquire_lease(1, "test-receiver", ttl=-1)
            with pytest.raises(ValueError):
                trainer.reserve_slot(1)  # not newer than the latest
            assert trainer.reserve_slot(2) == (0, 1)
            with pytest.raises(UnknownVersion):
                client.manifest(1)  # retired with its slot
        finally:
            conn.send(None)
            process.join(30)
            if process.is_alive():
                process.kill()
            transport.close()
