"""A real trainer publishes each finished step, each loaded checkpoint and (when asked) its
start-up weights through the sidecar; a separate process (this test) pulls the whole model over
NIXL and gets ExportHF's weights bit for bit; a leased version survives later steps."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_hf.convert import megatron_to_hf
from megatron_hf.spec import ModelSpec
from refit_sidecar.core.manifest import Box
from refit_sidecar.core.plan import Want, plan_pull, whole
from refit_sidecar.memory.region import Region
from refit_sidecar.pull.nixl_transport import NixlConfig, NixlTransport
from refit_sidecar.service.client import SidecarClient, UnknownVersion
from tests.support.batches import make_batch
from tests.support.damaged_checkpoints import resealed_copies
from tests.support.isolation import in_child_process
from tests.support.sidecar import running_sidecar
from tests.support.trainer import TrainerProcess, assert_bit_identical
from trainer_svc.domain import FailedPrecondition, LossConfig, OptimizerOverrides
from trainer_svc.runtime.publication import Publisher
from trainer_svc.runtime.snapshot_slot import Slot

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture
def sidecar(tmp_path: Path):
    with running_sidecar(tmp_path / "sidecar", "--when-all-slots-leased", "fail") as running:
        yield running


def _step(trainer: TrainerProcess, step_id: str) -> int:
    loss = LossConfig()
    trainer.client.begin_step(step_id, loss, OptimizerOverrides(learning_rate=1e-3))
    trainer.client.train_microbatch(step_id, "r", make_batch(seed=1, lengths=[9, 14], loss=loss))
    return trainer.client.finish_step(step_id).weights_version


def _pull(client: SidecarClient, transport: NixlTransport, version: int, wants=None):
    """{(name, box): tensor} of the wanted pieces (default: every whole tensor)."""
    client.wait_visible(version)  # ranks report a version just after the step that made it
    manifest = client.manifest(version)
    plan = plan_pull(manifest, whole(manifest) if wants is None else wants)
    dest = np.zeros(plan.nbytes, np.uint8)
    stats = transport.pull(plan, Region.of_array(dest), verify=wants is None)
    assert stats.nbytes > 0
    return {
        (t.name, t.box): torch.frombuffer(
            bytearray(dest[t.span].tobytes()), dtype=_TORCH_DTYPES[t.dtype.value]
        ).reshape(t.box.shape)
        for t in plan.targets
    }


def _wait_retired(client: SidecarClient, version: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            client.manifest(version)
        except UnknownVersion:
            return
        time.sleep(0.05)
    raise AssertionError(f"version {version} is still readable")


def _pull_hf(client: SidecarClient, transport: NixlTransport, version: int, spec: ModelSpec):
    megatron = {name: t for (name, _), t in _pull(client, transport, version).items()}
    return {name: tensor.numpy() for name, tensor in megatron_to_hf(megatron, spec).items()}


def _check_sub_boxes(client: SidecarClient, transport: NixlTransport, version: int) -> None:
    """Pieces of tensors equal the same slices of the whole tensors."""
    full = {name: t for (name, _), t in _pull(client, transport, version).items()}
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"  # TP dim 0, [gate; up]
    proj = "decoder.layers.1.self_attention.linear_proj.weight"  # TP dim 1
    last_stage = [n for n in full if n.startswith("decoder.layers.3.")]  # the last PP stage's
    wants = [
        Want(fc1, Box(((10, 20), (0, 64)))),
        Want(proj, Box(((0, 64), (20, 44)))),
        *(Want(n, Box.full(tuple(full[n].shape))) for n in last_stage),
    ]
    pieces = _pull(client, transport, version, wants)
    assert len(pieces) == len(wants)
    for (name, box), tensor in pieces.items():
        index = tuple(slice(a, b) for a, b in box.ranges)
        assert torch.equal(tensor, full[name][index]), name


@pytest.mark.parametrize(
    "layout",
    [
        # TP=2 publication is checked bit for bit by the fidelity matrix's default run (each
        # engine worker's installed slices against ExportHF) and by the loaded-checkpoint test.
        pytest.param(["--tp", "2"], id="tp2", marks=pytest.mark.slow),
        pytest.param(["--pp", "2"], id="pp2"),
        pytest.param(["--dp", "2"], id="dp2-distributed-optimizer"),
    ],
)
@in_child_process
def test_published_versions_equal_export_and_survive_while_leased(tmp_path, sidecar, layout):
    trainer = TrainerProcess(
        tmp_path / "trainer", [*layout, *sidecar.trainer_args(), "--refit-slots", "2"]
    )
    transport = NixlTransport.create(NixlConfig(name="test-puller", pull_timeout_s=60))
    client = sidecar.client()
    try:
        status = trainer.client.status()
        assert status.sidecar == sidecar.address and status.refit_snapshot_bytes > 0
        spec = ModelSpec.from_pretrained_dir(tmp_path / "trainer" / "builtin-model")
        assert _step(trainer, "s1") == 1
        assert client.wait_visible(1) == 1
        exported_1 = trainer.export("v1")
        lease = client.acquire_lease(1, "test", ttl=120)
        assert_bit_identical(_pull_hf(client, transport, 1, spec), exported_1)

        assert _step(trainer, "s2") == 2
        assert _step(trainer, "s3") == 3  # takes version 2's slot: version 1 is leased
        assert_bit_identical(_pull_hf(client, transport, 3, spec), trainer.export("v3"))
        assert_bit_identical(_pull_hf(client, transport, 1, spec), exported_1)
        _check_sub_boxes(client, transport, 3)
        client.release_lease(lease)
    finally:
        client.close()
        transport.close()
        assert trainer.stop() == 0


@in_child_process
def test_a_loaded_checkpoint_is_published_as_the_next_version(tmp_path, sidecar):
    """With `--refit-publish-start` the weights the trainer started with are version 1,
    readable before any step and equal to ExportHF; steps and loads number on from there."""
    args = ["--tp", "2", *sidecar.trainer_args(), "--refit-slots", "2", "--refit-publish-start"]
    trainer = TrainerProcess(tmp_path / "trainer", args)
    transport = NixlTransport.create(NixlConfig(name="load-puller", pull_timeout_s=60))
    client = sidecar.client()
    try:
        spec = ModelSpec.from_pretrained_dir(tmp_path / "trainer" / "builtin-model")
        assert trainer.client.status().weights_version == 1 and client.wait_visible(1) == 1
        assert_bit_identical(_pull_hf(client, transport, 1, spec), trainer.export("start"))
        assert _step(trainer, "s1") == 2
        saved = trainer.export("saved")
        trainer.client.save_checkpoint(trainer.workdir / "ckpt")
        assert _step(trainer, "s2") == 3
        # The slot of version 4 is reserved as soon as version 3 is readable, not at the step
        # that makes version 4: unleased version 2 is retired then.
        _wait_retired(client, 2)
        assert _step(trainer, "s3") == 4

        loaded = trainer.client.load_checkpoint(trainer.workdir / "ckpt")
        assert loaded.weights_version == 5 and client.wait_visible(5) == 5
        exported = trainer.export("loaded")
        assert_bit_identical(exported, saved)
        assert_bit_identical(_pull_hf(client, transport, 5, spec), exported)

        # Both slots leased and the sidecar's policy is `fail`: the load is refused before the
        # weights change, and nothing is published.
        leases = [client.acquire_lease(5, "test", ttl=120)]
        assert trainer.client.load_checkpoint(trainer.workdir / "ckpt").weights_version == 6
        assert client.wait_visible(6) == 6
        leases.append(client.acquire_lease(6, "test", ttl=120))
        with pytest.raises(FailedPrecondition, match="cannot publish"):
            trainer.client.load_checkpoint(trainer.workdir / "ckpt")
        assert trainer.client.status().weights_version == 6 and client.latest_version() == 6
        for lease in leases:
            client.release_lease(lease)
        assert trainer.client.load_checkpoint(trainer.workdir / "ckpt").weights_version == 7
        assert_bit_identical(_pull_hf(client, transport, 7, spec), saved)
    finally:
        client.close()
        transport.close()
        assert trainer.stop() == 0


@in_child_process
def test_a_trainer_publishing_every_second_step_publishes_those_and_every_load(tmp_path, sidecar):
    """`--refit-publish-every 2`: only the even versions of finished steps are published (the
    odd ones are never readable), a loaded checkpoint is published whatever its version, a
    refused one holds no slot, and each published version equals ExportHF."""
    args = [*sidecar.trainer_args(), "--refit-slots", "2", "--refit-publish-every", "2"]
    trainer = TrainerProcess(tmp_path / "trainer", args)
    transport = NixlTransport.create(NixlConfig(name="every-puller", pull_timeout_s=60))
    client = sidecar.client()
    try:
        spec = ModelSpec.from_pretrained_dir(tmp_path / "trainer" / "builtin-model")
        assert _step(trainer, "s1") == 1 and _step(trainer, "s2") == 2
        assert client.wait_visible(2) == 2
        assert_bit_identical(_pull_hf(client, transport, 2, spec), trainer.export("v2"))
        saved = trainer.export("saved")
        trainer.client.save_checkpoint(trainer.workdir / "ckpt")
        assert _step(trainer, "s3") == 3 and _step(trainer, "s4") == 4
        assert client.wait_visible(4) == 4
        assert_bit_identical(_pull_hf(client, transport, 4, spec), trainer.export("v4"))
        for unpublished in (1, 3):
            with pytest.raises(UnknownVersion):
                client.manifest(unpublished)
        assert trainer.client.load_checkpoint(trainer.workdir / "ckpt").weights_version == 5
        assert client.wait_visible(5) == 5  # odd, and published: a load always is
        assert_bit_identical(_pull_hf(client, transport, 5, spec), saved)
        assert _step(trainer, "s6") == 6 and client.wait_visible(6) == 6
        # Refused while reading, after rank 0 reserved a slot for version 7, which no step
        # publishes: the sidecar must not keep it being published, or no later version could.
        copies = resealed_copies(trainer.workdir / "ckpt", trainer.workdir / "damaged", rank=0)
        (not_finite,) = (path for name, path in copies.items() if "not finite" in name)
        with pytest.raises(FailedPrecondition, match="not finite"):
            trainer.client.load_checkpoint(not_finite)
        assert _step(trainer, "s7") == 7 and client.latest_version() == 6
        assert _step(trainer, "s8") == 8 and client.wait_visible(8) == 8
    finally:
        client.close()
        transport.close()
        assert trainer.stop() == 0


class _Watched(torch.Tensor):
    """A parameter's bytes that note the slot's words whenever they are copied (one by one
    or in a `_foreach_copy_`)."""

    words: torch.Tensor
    seen: list[list[int]]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (torch.Tensor.copy_, torch._foreach_copy_):
            cls.seen.append(cls.words.tolist())
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_snapshot_zeroes_the_words_then_names_each_piece_after_its_bytes() -> None:
    parameter = torch.nn.Parameter(torch.arange(8, dtype=torch.float32))
    words = torch.full((2,), 3, dtype=torch.int64)  # the slot held version 3
    slot_bytes = torch.zeros(32, dtype=torch.uint8)
    source = parameter.data.view(torch.uint8).as_subclass(_Watched)
    _Watched.words, _Watched.seen = words, []
    pieces = [([slot_bytes[:16]], [source[:16]]), ([slot_bytes[16:]], [source[16:]])]
    slot = Slot(None, pieces, None, words, None)  # type: ignore[arg-type]
    publisher = Publisher(None, [slot], {"w": parameter}, None, torch.device("cpu"))  # type: ignore[arg-type]
    try:
        assert publisher.snapshot(0, 5) is None  # done on return on the CPU
    finally:
        publisher._reporter.shutdown()
    # No byte changed before every word said 0; each word named 5 once its piece had landed.
    assert _Watched.seen == [[0, 0], [5, 0]]
    assert words.tolist() == [5, 5]
    assert torch.equal(slot_bytes, parameter.data.view(torch.uint8))


def test_a_slots_report_carries_each_versions_own_checksums() -> None:
    # The slot keeps one report message and rewrites its version and checksums per request
    # (the reporter sends it before the next): the second version's report must not carry
    # the first's checksums.
    from types import SimpleNamespace

    from refit_sidecar.core.manifest import MemType
    from refit_sidecar.integrity.checksum import checksum
    from trainer_refit.v1 import refit_pb2 as pb

    data = {"a": np.arange(16, dtype=np.uint8), "b": np.full(8, 7, dtype=np.uint8)}
    source = SimpleNamespace(arena=SimpleNamespace(mem_type=MemType.DRAM), view=data.__getitem__)
    report = pb.PublishShardsRequest(rank=0)
    for name in data:
        report.parameters.add(name=name).shards.add()
    slot = Slot(source, [], report, None, None)  # type: ignore[arg-type]
    first = slot.request(4, generation=11)
    assert (first.version, first.generation) == (4, 11)
    assert [p.shards[0].crc32 for p in first.parameters] == [
        checksum(data["a"]),
        checksum(data["b"]),
    ]
    sent = first.SerializeToString()
    data["a"][3] ^= 0xFF
    second = slot.request(6, generation=12)
    assert (second.version, second.generation) == (6, 12)
    assert [p.shards[0].crc32 for p in second.parameters] == [
        checksum(data["a"]),
        checksum(data["b"]),
    ]
    assert pb.PublishShardsRequest.FromString(sent).parameters[0].shards[0].crc32 != (
        second.parameters[0].shards[0].crc32
    )
    assert not report.parameters[0].shards[0].HasField("crc32")  # the template stays bare
