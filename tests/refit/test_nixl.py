"""Real NIXL pulls (UCX over DRAM) from a source in another process.

The source process holds the TP=2 shards of a few tensors (a fused fc1 with parts=2, dim-1
splits, a dim-0 split, a replicated norm), one NIXL agent per rank; the puller is this process.
Failure tests start their own source and kill or freeze it.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import numpy as np
import pytest

from refit_sidecar.core.manifest import (
    AgentRecord,
    Box,
    DType,
    Manifest,
    ParameterRecord,
    ShardLocation,
    ShardRecord,
)
from refit_sidecar.core.plan import PullPlan, Want, plan_pull, whole
from refit_sidecar.memory.region import Region
from refit_sidecar.publish.shard_source import SourceConfig
from refit_sidecar.publish.shard_specs import ShardSpec, megatron_shard_spec, split_pieces
from refit_sidecar.pull.chunking import chunk_bounds
from refit_sidecar.pull.nixl_transport import NixlConfig, NixlTransport
from refit_sidecar.pull.pending_pull import PendingPull, Xfer
from refit_sidecar.pull.transport import SourceLost
from tests.refit.shards import index, random_global
from tests.refit.source_worker import serve
from tests.support.isolation import in_child_process

Tensors = dict[str, tuple[tuple[int, ...], DType]]
TENSORS: Tensors = {
    "decoder.layers.0.mlp.linear_fc1.weight": ((64, 24), DType.FLOAT32),
    "decoder.layers.0.mlp.linear_fc2.weight": ((24, 32), DType.FLOAT32),
    "decoder.layers.0.self_attention.linear_proj.weight": ((24, 24), DType.BFLOAT16),
    "embedding.word_embeddings.weight": ((128, 24), DType.FLOAT16),
    "decoder.layers.0.input_layernorm.weight": ((24,), DType.FLOAT32),
}
FC1, FC2, _, EMBEDDING, _ = TENSORS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Source:
    process: BaseProcess
    conn: Connection
    manifest: Manifest

    def publish(self, version: int, seed: int) -> Manifest:
        self.conn.send((version, seed))
        assert self.conn.poll(60), "source did not publish"
        self.manifest = self.conn.recv()
        return self.manifest

    def stop(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)  # type: ignore[arg-type]
        self.process.join(30)


def _start(ranks: list[tuple[SourceConfig, list[ShardSpec]]], seed: int | None) -> Source:
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=serve, args=(child, ranks, seed), daemon=True)
    process.start()
    child.close()
    if not conn.poll(120):
        process.kill()
        pytest.fail("the source process did not publish a manifest")
    return Source(process, conn, conn.recv())


def _tp2_ranks(
    tensors: Tensors, listen: bool, tag: str
) -> list[tuple[SourceConfig, list[ShardSpec]]]:
    return [
        (
            SourceConfig(name=f"{tag}-tp{r}", listen_port=_free_port() if listen else None),
            [megatron_shard_spec(n, s, d, tp_rank=r, tp_size=2) for n, (s, d) in tensors.items()],
        )
        for r in range(2)
    ]


def _start_listening(tensors: Tensors, *, tag: str, seed: int) -> Source:
    """A source whose ranks take metadata requests on ports found free: another process may
    bind such a port before NIXL does (the source then dies at start), so it starts again on
    new ports."""
    for _ in range(2):
        try:
            return _start(_tp2_ranks(tensors, listen=True, tag=tag), seed=seed)
        except EOFError:
            pass
    return _start(_tp2_ranks(tensors, listen=True, tag=tag), seed=seed)


@pytest.fixture(scope="module")
def source() -> Iterator[Source]:
    src = _start_listening(TENSORS, tag="src", seed=1)
    yield src
    src.conn.send(None)
    src.process.join(30)
    src.stop()


@pytest.fixture(scope="module")
def puller() -> Iterator[NixlTransport]:
    transport = NixlTransport.create(NixlConfig(name="puller", pull_timeout_s=60))
    yield transport
    transport.close()


def _assert_pulled(
    plan: PullPlan, dest: np.ndarray, seed: int = 1, tensors: Tensors = TENSORS
) -> None:
    """Every target of `plan` in `dest` holds the source's bytes (of `random_global`)."""
    for t in plan.targets:
        shape, dtype = tensors[t.name]
        expected = random_global(t.name, shape, dtype, seed)[index(t.box)]
        assert dest[t.span].tobytes() == expected.tobytes(), t


def _pull_and_check(
    transport: NixlTransport,
    manifest: Manifest,
    wants: list[Want],
    seed: int,
    tensors: Tensors = TENSORS,
) -> PullPlan:
    plan = plan_pull(manifest, wants)
    dest = np.zeros(plan.nbytes, np.uint8)
    stats = transport.pull(plan, Region.of_array(dest), verify=True)
    assert stats.nbytes == plan.bytes_read == sum(t.nbytes for t in plan.targets)
    assert stats.reads == plan.num_reads
    assert stats.verified_shards == sum(r.complete for r in plan.reads)
    _assert_pulled(plan, dest, seed, tensors)
    return plan


def test_whole_tensors_are_bit_exact(source: Source, puller: NixlTransport) -> None:
    plan = _pull_and_check(puller, source.manifest, whole(source.manifest), seed=1)
    assert {r.location.agent for r in plan.reads} == {"src-tp0", "src-tp1"}
    assert all(r.complete for r in plan.reads)


def test_row_range_inside_one_shard(source: Source, puller: NixlTransport) -> None:
    plan = _pull_and_check(puller, source.manifest, [Want(EMBEDDING, Box(((70, 90), (0, 24))))], 1)
    assert plan.num_reads == 1 and plan.reads[0].location.agent == "src-tp1"


def test_column_range_spanning_two_shards(source: Source, puller: NixlTransport) -> None:
    plan = _pull_and_check(puller, source.manifest, [Want(FC2, Box(((0, 24), (10, 25))))], 1)
    assert plan.num_reads == 48  # one read per row from each rank: prepped descriptor lists


def test_fc1_narrow_of_a_tp4_receiver(source: Source, puller: NixlTransport) -> None:
    wants = [Want(FC1, Box(((8, 16), (0, 24)))), Want(FC1, Box(((40, 48), (0, 24))))]
    plan = _pull_and_check(puller, source.manifest, wants, 1)
    assert plan.num_reads == 2


def test_refreshed_versions_reuse_registrations_and_requests(
    source: Source, puller: NixlTransport
) -> None:
    """The source refreshes in place (same registration, same metadata); the puller's
    registered destination lets it re-post the requests prepared for the previous version."""
    first = source.manifest
    plan = plan_pull(first, whole(first))
    array = np.zeros(plan.nbytes, np.uint8)
    dest = Region.of_array(array)
    puller.register(dest)
    try:
        for version, seed in [(2, 2), (3, 1)]:
            manifest = source.publish(version, seed)
            assert manifest.agents == first.agents
            plan = plan_pull(manifest, whole(manifest))
            stats = puller.pull(plan, dest, verify=True)
            assert stats.reposted == (stats.transfers if version == 3 else 0)
            assert stats.verified_shards == len(plan.reads)
            for t in plan.targets:
                shape, dtype = TENSORS[t.name]
                expected = random_global(t.name, shape, dtype, seed)[index(t.box)]
                assert array[t.span].tobytes() == expected.tobytes(), t
    finally:
        puller.deregister(dest)


def test_a_pull_is_posted_as_requests_of_bounded_size(source: Source) -> None:
    """With `request_bytes` smaller than the tensors, a pull posts several requests per source
    (long reads cut), all at once; the bytes are the same, and the next pull re-posts them."""
    size = 1000  # not a multiple of any row: reads are cut mid-row
    transport = NixlTransport.create(
        NixlConfig(name="small-requests-puller", pull_timeout_s=60, request_bytes=size)
    )
    try:
        plan = plan_pull(source.manifest, whole(source.manifest))
        array = np.zeros(plan.nbytes, np.uint8)
        dest = Region.of_array(array)
        transport.register(dest)
        for attempt in range(2):
            stats = transport.pull(plan, dest, verify=True)
            per_agent = {
                agent: sum(r.nbytes for r in plan.reads if r.location.agent == agent)
                for agent in {r.location.agent for r in plan.reads}
            }
            assert stats.transfers >= sum(-(-n // (2 * size)) for n in per_agent.values())
            assert stats.transfers > len(per_agent)
            assert stats.reads >= plan.num_reads  # long reads were cut
            assert stats.nbytes == plan.bytes_read
            assert stats.verified_shards == len(plan.reads)
            assert stats.reposted == (stats.transfers if attempt else 0)
            _assert_pulled(plan, array)
            array[:] = 0
    finally:
        transport.close()


def test_a_pull_keeps_at_most_its_window_of_requests_in_flight(source: Source) -> None:
    """`requests_in_flight`: a pull posts that many requests, in destination order, and the
    next as each completes; the bytes are the same, and they land in order."""
    transport = NixlTransport.create(
        NixlConfig(
            name="windowed-puller", pull_timeout_s=60, request_bytes=1000, requests_in_flight=2
        )
    )
    try:
        plan = plan_pull(source.manifest, whole(source.manifest))
        array = np.zeros(plan.nbytes, np.uint8)
        dest = Region.of_array(array)
        transport.register(dest)
        pending = transport.start(plan, dest)
        assert len(pending.queued) == len(pending.xfers) - 2 > 0
        starts = [int(spans.min()) for spans, _ in pending.spans]
        assert starts == sorted(starts)  # posted in destination order
        prefixes: list[int] = []
        stats = pending.wait(on_landed=prefixes.append)
        assert not pending.queued and stats.transfers == len(pending.xfers)
        assert prefixes == sorted(prefixes) and prefixes[-1] == plan.nbytes
        _assert_pulled(plan, array)
    finally:
        transport.close()
    with pytest.raises(ValueError):
        NixlConfig(name="bad", requests_in_flight=-1)


def test_tapered_requests_halve_towards_the_ends_and_carry_the_same_bytes(source: Source) -> None:
    """`request_taper`: each source's requests are cut at `chunk_bounds`, so its first and
    last requests are `request_bytes` halved `taper` times; the bytes are the same."""
    size, taper = 4096, 2
    transport = NixlTransport.create(
        NixlConfig(
            name="tapered-puller",
            pull_timeout_s=60,
            request_bytes=size,
            request_taper=taper,
            requests_in_flight=2,
        )
    )
    try:
        plan = plan_pull(source.manifest, whole(source.manifest))
        array = np.zeros(plan.nbytes, np.uint8)
        dest = Region.of_array(array)
        transport.register(dest)
        pending = transport.start(plan, dest)
        sizes: dict[str, list[int]] = {}
        for xfer in pending.xfers:
            sizes.setdefault(xfer.agent, []).append(int(xfer.nbytes))
        pending.wait()
        for agent, taken in sizes.items():
            total = sum(r.nbytes for r in plan.reads if r.location.agent == agent)
            assert sum(taken) == total
            bounds = chunk_bounds(total, size, taper)
            assert taken == np.diff([0, *bounds.tolist(), total]).tolist(), agent
            assert taken[-1] == taken[0] == size >> taper
        array[:] = 0
        stats = transport.pull(plan, dest, verify=True)
        assert stats.verified_shards == len(plan.reads)
        _assert_pulled(plan, array)
    finally:
        transport.close()
    with pytest.raises(ValueError):
        NixlConfig(name="bad", request_bytes=4, request_taper=3)


def test_a_pull_says_how_far_its_destination_has_landed(source: Source) -> None:
    """`PendingPull.wait(on_landed=...)`: each call's offset has every byte before it in place
    (what a running check starts on), it only grows, and the last is the whole destination."""
    transport = NixlTransport.create(
        NixlConfig(name="landed-puller", pull_timeout_s=60, request_bytes=1000)
    )
    try:
        plan = plan_pull(source.manifest, whole(source.manifest))
        array = np.zeros(plan.nbytes, np.uint8)
        dest = Region.of_array(array)
        transport.pull(plan, dest)
        expected = array.copy()
        array[:] = 0
        seen: list[int] = []

        def landed(n: int) -> None:
            assert np.array_equal(array[:n], expected[:n]), n
            seen.append(n)

        transport.start(plan, dest).wait(on_landed=landed)
        assert seen and seen[-1] == plan.nbytes == dest.nbytes
        assert seen == sorted(set(seen))
        assert np.array_equal(array, expected)
    finally:
        transport.close()


def test_a_pull_does_its_idle_work_while_its_requests_are_in_flight() -> None:
    """`PendingPull.wait(idle=...)`: called at the turns where the pull would pause (a request
    in flight) until it returns True, and never after; each request is still seen to land.
    (NIXL completes reads over shared memory inside `transfer()`, so the turns are those of
    a request that an agent says is in flight five times.)"""

    class Agent:
        looks = 0

        def check_xfer_state(self, handle: object) -> str:
            self.looks += 1
            return "DONE" if self.looks > 5 else "PROC"

    agent = Agent()
    transport = dataclasses.make_dataclass("Transport", [("_agent", Agent)])(agent)
    array = np.zeros(8, np.uint8)
    dest = Region.of_array(array)
    xfer = Xfer(b"key", "source", dest, None, (), reads=1, nbytes=8)
    now = time.perf_counter()
    pending = PendingPull(transport, now + 10, now, False, dest, window=1)  # type: ignore[arg-type]
    pending.xfers.append(xfer)
    pending.posted.append(xfer)
    seen: list[int] = []

    def idle() -> bool:
        seen.append(agent.looks)
        return len(seen) == 2

    stats = pending.wait(idle=idle)
    assert seen == [1, 2]  # two turns with the request in flight; done after the second
    assert agent.looks == 6 and xfer.done and stats.nbytes == 8


def test_metadata_fetched_from_the_source_listener(source: Source) -> None:
    agents = {
        n: AgentRecord(n, host=a.host, port=a.port) for n, a in source.manifest.agents.items()
    }
    manifest = dataclasses.replace(source.manifest, agents=agents)
    transport = NixlTransport.create(
        NixlConfig(name="listener-puller", pull_timeout_s=60, metadata_listener=True)
    )
    try:
        _pull_and_check(transport, manifest, whole(manifest), seed=1)
    finally:
        transport.close()
    # Closing let go of the agent (its native teardown ran then, not at some collection
    # later); a closed transport says so rather than reaching a freed agent, and closes again.
    with pytest.raises(RuntimeError, match="'listener-puller' is closed"):
        transport.metadata()
    transport.close()


def _lonely_manifest(agent: AgentRecord) -> Manifest:
    location = ShardLocation.contiguous(agent=agent.name, address=1 << 20, shape=(4,), itemsize=4)
    _, pieces = split_pieces((4,), None, 1, 0, 1)
    record = ParameterRecord("w", (4,), DType.FLOAT32, (ShardRecord(location, pieces),))
    return Manifest(1, (record,), {agent.name: agent})


@in_child_process
def test_unanswered_listener_gives_source_lost() -> None:
    manifest = _lonely_manifest(AgentRecord("ghost", host="127.0.0.1", port=_free_port()))
    transport = NixlTransport.create(
        NixlConfig(name="ghost-puller", connect_timeout_s=1, metadata_listener=True)
    )
    plan = plan_pull(manifest, whole(manifest))
    with pytest.raises(SourceLost, match="no metadata"):
        transport.pull(plan, Region.of_array(np.zeros(plan.nbytes, np.uint8)))
    transport.close()


def test_a_puller_without_its_listener_refuses_a_listener_only_source(
    puller: NixlTransport,
) -> None:
    manifest = _lonely_manifest(AgentRecord("listener-only", host="127.0.0.1", port=1))
    plan = plan_pull(manifest, whole(manifest))
    with pytest.raises(SourceLost, match="metadata_listener"):
        puller.pull(plan, Region.of_array(np.zeros(plan.nbytes, np.uint8)))


BIG: Tensors = {"decoder.layers.0.mlp.linear_fc2.weight": ((8192, 8192), DType.FLOAT32)}  # 256 MiB
SMALL: Tensors = {"decoder.layers.0.input_layernorm.weight": ((1024,), DType.FLOAT32)}


@pytest.fixture
def tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    """UCX over TCP in both processes: a READ then needs the source's progress thread, so a
    frozen (SIGSTOP) source keeps a pull in flight until it is killed or the deadline passes.
    Over shared memory the puller copies by itself and a pull completes inside transfer()."""
    monkeypatch.setenv("UCX_TLS", "tcp")


def _frozen_big_source(
    tag: str, transport: NixlTransport, seed: int | None = None
) -> tuple[Source, PullPlan]:
    src = _start(_tp2_ranks(BIG | SMALL, listen=False, tag=tag), seed=seed)
    warm = plan_pull(src.manifest, whole(src.manifest, list(SMALL)))
    transport.pull(warm, Region.of_array(np.zeros(warm.nbytes, np.uint8)))  # connects
    os.kill(src.process.pid, signal.SIGSTOP)  # type: ignore[arg-type]
    plan = plan_pull(src.manifest, whole(src.manifest, list(BIG)))
    assert plan.num_reads == 2 * 8192
    return src, plan


@pytest.mark.usefixtures("tcp")
@in_child_process
def test_source_killed_mid_pull_raises_source_lost() -> None:
    transport = NixlTransport.create(NixlConfig(name="kill-puller", pull_timeout_s=120))
    src, plan = _frozen_big_source("kill", transport)
    try:
        pending = transport.start(plan, Region.of_array(np.zeros(plan.nbytes, np.uint8)))
        assert pending.in_flight  # the frozen source cannot serve a READ over TCP
        os.kill(src.process.pid, signal.SIGKILL)  # type: ignore[arg-type]
        with pytest.raises(SourceLost):
            pending.wait()
    finally:
        src.stop()
        transport.close()


@pytest.mark.usefixtures("tcp")
@in_child_process
def test_stalled_source_hits_the_deadline_then_dead_source_raises() -> None:
    transport = NixlTransport.create(NixlConfig(name="stall-puller", pull_timeout_s=2))
    src, plan = _frozen_big_source("stall", transport)
    dest = Region.of_array(np.zeros(plan.nbytes, np.uint8))
    try:
        with pytest.raises(SourceLost, match="deadline"):
            transport.pull(plan, dest)
        src.stop()
        with pytest.raises(SourceLost):
            transport.pull(plan, dest)
    finally:
        src.stop()
        transport.close()


@pytest.mark.usefixtures("tcp")
@in_child_process
def test_a_source_late_once_serves_the_next_pull_once_it_answers_again() -> None:
    """A pull past its deadline disconnects the source; the next pull reconnects it and, the
    source answering again, gets every byte: one slow moment does not lose a live source."""
    transport = NixlTransport.create(NixlConfig(name="late-puller", pull_timeout_s=5))
    src, plan = _frozen_big_source("late", transport, seed=3)
    try:
        with pytest.raises(SourceLost, match="deadline"):
            transport.pull(plan, Region.of_array(np.zeros(plan.nbytes, np.uint8)))
        os.kill(src.process.pid, signal.SIGCONT)  # type: ignore[arg-type]
        for _ in range(2):
            _pull_and_check(transport, src.manifest, whole(src.manifest, list(BIG)), 3, BIG)
    finally:
        src.stop()
        transport.close()


@in_child_process
def test_pull_from_exited_source_raises_source_lost() -> None:
    """Default transports (shared memory): a source gone between two pulls."""
    transport = NixlTransport.create(NixlConfig(name="exit-puller", pull_timeout_s=60))
    src = _start(_tp2_ranks(SMALL, listen=False, tag="exit"), seed=None)
    plan = plan_pull(src.manifest, whole(src.manifest))
    dest = Region.of_array(np.zeros(plan.nbytes, np.uint8))
    try:
        transport.pull(plan, dest)
        src.stop()
        with pytest.raises(SourceLost):
            transport.pull(plan, dest)
    finally:
        src.stop()
        transport.close()
