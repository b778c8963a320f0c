"""A direct receiver reads a version before the sidecar declares it readable: asked for ahead
(`Receiver.expect`), its lease comes when the trainer reserves the version's slot, the pull
starts once the ranks' version words name the version, and the checksums the ranks report
are compared when they come. The installed weights equal ExportHF; a byte flipped in a
rank's slot, checksums that never come, or a manifest other than the lease named fail the
refit and keep the installed version, also in an engine's tensors that live in staging
(inference_ext/staged_tensors.py), which a fetch dropped before its install restores too. One TP=2
trainer on the CPU serves every case. A trainer without version words is waited for on the
sidecar."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from inference_ext.receiver import Receiver, RefitError
from inference_ext.refit_options import RefitOptions
from inference_ext.slices import ReceiverLayout
from megatron_hf.convert import hf_names
from megatron_hf.spec import ModelSpec
from refit_sidecar.core.manifest import DType
from refit_sidecar.core.plan import Checksums, plan_pull, whole
from refit_sidecar.publish.shard_specs import megatron_shard_spec
from refit_sidecar.pull.early_reads import BeforeReadable, ManifestChanged
from refit_sidecar.pull.leasing import HeldBy
from refit_sidecar.pull.transport import SourceLost
from refit_sidecar.pull.version_words import VersionWords, WordTimeout
from refit_sidecar.service.client import Lease, UnknownVersion, VersionChecksums
from tests.refit.shards import in_memory_manifest, random_global, shard_of
from tests.support.fidelity import PROMPTS, gap, train_step, trainer_logprobs
from tests.support.isolation import in_child_process
from tests.support.receiver import (
    assert_exported,
    corrupt_one_byte,
    refit_in_place,
    refit_with_stats,
    write_memory,
)
from tests.support.sidecar import running_sidecar
from tests.support.trainer import TrainerProcess, rank_process


class _Answered:
    """A GetChecksums answer already in: `value`, or `error` raised."""

    def __init__(self, value: VersionChecksums | None = None, error: Exception | None = None):
        self._value, self._error = value, error

    def result(self, timeout: float | None = None) -> VersionChecksums:
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value

    def done(self) -> bool:
        return True

    def answered(self) -> bool:
        return self._error is None

    def exception(self, timeout: float | None = None) -> Exception | None:
        return self._error

    def cancel(self) -> bool:
        return False


def test_sources_without_version_words_are_waited_for_on_the_sidecar() -> None:
    """A trainer that publishes no version words (an older one): the pull of a version leased
    before it was readable starts once GetChecksums answers (the version is readable), reads
    no word, and its checksums map onto the plan's reads, whatever their order; a manifest
    key other than the lease's fails it."""
    tensors = {
        "decoder.layers.0.mlp.linear_fc2.weight": ((24, 32), DType.FLOAT32),  # split in dim 1
        "decoder.layers.0.self_attention.linear_qkv.weight": ((48, 24), DType.BFLOAT16),
        "decoder.final_layernorm.weight": ((24,), DType.FLOAT32),  # replicated
    }
    placed = []
    for rank in range(2):
        for name, (shape, dtype) in tensors.items():
            spec = megatron_shard_spec(name, shape, dtype, tp_rank=rank, tp_size=2)
            local = shard_of(random_global(spec.parameter, shape, dtype, 3), spec)
            placed.append((f"rank-{rank}", spec, np.ascontiguousarray(local).reshape(-1)))
    manifest = in_memory_manifest(2, placed)
    assert all(agent.version_word is None for agent in manifest.agents.values())
    plan = plan_pull(manifest, whole(manifest))
    order = [(p.name, len(p.shards)) for p in manifest.parameters]
    flat = tuple(Checksums(s.crc32, None) for p in manifest.parameters for s in p.shards)
    asked: list[int] = []

    class Sidecar:
        key = b"slot key"

        def checksums_later(self, version: int, wait_s: float) -> _Answered:
            asked.append(version)
            return _Answered(VersionChecksums(version, self.key, flat))

    sidecar = Sidecar()
    early_reader = BeforeReadable(sidecar, transport=None)  # type: ignore[arg-type]
    lease = Lease("lease", 3, 30.0, b"slot key", "r", pending=True)
    early = early_reader.start(lease, plan, order, verify=True, deadline=time.monotonic() + 5)
    assert asked == [3] and early.plan.version == 3  # no word read: it has no transport
    assert early.checksums is not None
    assert early.checksums.prepare()  # the answer is in: converted now
    assert early.checksums.result() == [Checksums(r.crc32, None) for r in plan.reads]
    # Five of the six shards are read (the replicated norm once), so positions are not 0..n.
    assert len({(r.parameter, r.shard) for r in plan.reads}) == len(flat) - 1 == 5
    unverified = early_reader.start(lease, plan, order, verify=False, deadline=time.monotonic())
    assert unverified.checksums is None and asked == [3, 3]  # it still waits for readable
    sidecar.key = b"another slot"
    moved = early_reader.start(lease, plan, order, verify=True, deadline=time.monotonic() + 5)
    assert moved.checksums is not None
    assert moved.checksums.prepare()  # its error waits for `result`, on the pull's path
    with pytest.raises(ManifestChanged, match="not the one its lease named"):
        moved.checksums.result()


@in_child_process
def test_a_receiver_reads_a_version_before_it_is_readable(tmp_path: Path) -> None:
    with running_sidecar(tmp_path / "sidecar") as sidecar:
        trainer = TrainerProcess(
            tmp_path / "trainer",
            [
                "--tp",
                "2",
                *sidecar.trainer_args(),
                "--refit-slots",
                "2",
                # Each rank's slot is copied in several pieces, read behind the copy.
                "--refit-first-piece-bytes",
                "4096",
            ],
        )
        spec = ModelSpec.from_pretrained_dir(tmp_path / "trainer" / "builtin-model")

        def receiver(name: str, names: list[str] | None = None, **options: object) -> Receiver:
            config = RefitOptions.from_dict(
                {
                    "receiver_id": name,
                    "pull_timeout_s": 60,
                    "token_file": sidecar.token_file(),
                    **options,
                }
            )
            return Receiver(
                sidecar.address,
                spec,
                ReceiverLayout(),
                hf_names(spec) if names is None else names,
                options=config,
                device=torch.device("cpu"),
            )

        early, late = receiver("early"), receiver("late", read_before_readable=False)
        whole = receiver("whole", read_behind_copy=False)
        unverified = receiver("unverified", verify_checksums=False)
        norms = receiver("norms", [n for n in hf_names(spec) if n.endswith("norm.weight")])
        slow = receiver("slow", lease_ttl_s=3.0)
        try:
            # Version 1 is the trainer's first report: no slot's layout was known before it,
            # so its lease waits for the version and its plan comes from the manifest. That
            # report describes the ranks' other slot: version 2, the first into slot 1, is
            # leased at its reservation with that layout, planned ahead and read behind the
            # copy like every later version.
            for version in (1, 2):
                early.expect(version)
                whole.expect(version)
                assert train_step(trainer, f"s{version}", seed=version) == version
                installed, stats = refit_with_stats(early, version)
                assert stats.expected and stats.before_readable == (version == 2)
                refit_with_stats(whole, version)
            assert stats.replayed_by_key and stats.gated_s > 0
            assert_exported(trainer, installed, "v2")

            # Version 3 goes into slot 0 again: leased at its reservation, read behind the
            # ranks' copies (each request once its pieces' words name 3), or once the last
            # words do.
            for receiver_ in (early, late, whole):
                receiver_.expect(3)
            assert train_step(trainer, "s3", seed=3) == 3
            installed, stats = refit_with_stats(early, 3)
            assert stats.before_readable and stats.expected and stats.replayed_by_key
            assert len(stats.bytes_by_source) == 2  # the trainer's two ranks
            assert sum(stats.bytes_by_source.values()) == stats.bytes_pulled
            assert stats.sidecar_readable_at == 0.0
            assert stats.gated_s > 0  # its requests waited at the pieces' gate
            late_installed, late_stats = refit_with_stats(late, 3)
            assert late_stats.expected and not late_stats.before_readable
            assert stats.verified_shards == late_stats.verified_shards > 0
            whole_installed, whole_stats = refit_with_stats(whole, 3)
            assert whole_stats.before_readable and whole_stats.gated_s == 0
            assert_exported(trainer, installed, "v3")
            assert_exported(trainer, late_installed, "v3-late")
            assert_exported(trainer, whole_installed, "v3-whole")
            # Some of its reads are parts of shards (a TP=1 receiver of TP=2 fused tensors),
            # which no checksum covers: the version words say the slot was not overwritten.
            assert stats.lease_held_by is HeldBy.WORDS
            # A receiver of whole shards only (replicated norms) verifies every byte it read.
            norm_weights, norm_stats = refit_with_stats(norms, 3)
            assert norm_stats.lease_held_by is HeldBy.CHECKSUMS and norm_weights
            assert norm_stats.verified_shards == len(norm_weights)

            # Unverified, the ranks' version words after the pull say its bytes were not
            # overwritten (a rank zeroes them before it overwrites the slot): no EndLease round
            # trip. A word that changed under the pull sends it to the sidecar instead.
            plain, plain_stats = refit_with_stats(unverified, 3)
            assert plain_stats.lease_held_by is HeldBy.WORDS and plain_stats.verified_shards == 0
            assert_exported(trainer, plain, "v3-unverified")
            launcher = psutil.Process(trainer.process.pid)
            rank0 = rank_process(launcher, 0)
            word = next(
                a.version_word
                for a in unverified.client.manifest(3).agents.values()
                if a.rank == 0 and a.version_word is not None
            )
            pull = unverified.transport.pull

            def pull_then_zero(*args: Any, **kwargs: Any) -> Any:
                stats = pull(*args, **kwargs)
                write_memory(rank0, word.address, bytes(8))  # as a rank starting its next copy
                return stats

            unverified.transport.pull = pull_then_zero  # type: ignore[method-assign]
            try:
                plain, plain_stats = refit_with_stats(unverified, 3)
            finally:
                unverified.transport.pull = pull  # type: ignore[method-assign]
                write_memory(rank0, word.address, (3).to_bytes(8, "little"))
            assert plain_stats.lease_held_by is HeldBy.SIDECAR  # it held: nothing was copied
            assert_exported(trainer, plain, "v3-confirmed")

            # A byte flipped in rank 0's slot after the rank reported its checksums.
            early.expect(4)
            assert train_step(trainer, "s4", seed=4) == 4
            with sidecar.client() as client:
                client.wait_visible(4, timeout=30)
                agents = list(client.manifest(4).agents.values())
            assert all(a.pieces is not None and len(a.pieces.ends) > 2 for a in agents)
            corrupted = corrupt_one_byte(sidecar, 4, rank0)
            with pytest.raises(RefitError, match=f"{corrupted} shard \\d .*crc32"):
                early.fetch(4)
            assert early.installed_version == 3

            # The words themselves: version 4's slot names 4, not a later or an earlier one.
            words = VersionWords(early.transport)
            try:
                assert words.wait(agents, 4, time.monotonic() + 10) == 1
                with pytest.raises(WordTimeout, match="did not name version 6"):
                    words.wait(agents, 6, time.monotonic() + 0.3)
                with pytest.raises(SourceLost, match="holds version 4, not 2"):
                    words.wait(agents, 2, time.monotonic() + 10)
            finally:
                words.release()

            # Checksums that never come (a rank died after its copy), and checksums of a
            # manifest other than the one the lease named: nothing installs.
            real = early.client.checksums_later
            for version, answer, error in (
                (5, _Answered(error=UnknownVersion("version 5 is not readable")), "not readable"),
                (6, _Answered(VersionChecksums(6, b"another", ())), "not the one its lease named"),
            ):
                early.client.checksums_later = lambda v, wait_s, a=answer: a  # type: ignore[method-assign]
                early.expect(version)
                assert train_step(trainer, f"s{version}", seed=version) == version
                with pytest.raises(RefitError, match=error):
                    early.fetch(version)
                assert early.installed_version == 3

            early.client.checksums_later = real  # type: ignore[method-assign]
            early.expect(7)
            assert train_step(trainer, "s7", seed=7) == 7
            installed, stats = refit_with_stats(early, 7)
            assert stats.before_readable and stats.verified_shards > 0
            assert_exported(trainer, installed, "v7")

            # An engine whose tensors live in staging: version 8 installs by copy and adopts
            # them, version 9 is pulled straight into them; a byte flipped in version 10 and a
            # fetch of version 11 dropped before its install leave them on version 9.
            # The norms held in float64, as an engine casting the trainer's dtype would: the
            # receiver casts them in itself.
            engine = {
                name: tensor.to(torch.float64 if "norm" in name else tensor.dtype)
                for name, tensor in installed.items()
            }
            cast = {name for name, tensor in engine.items() if tensor.dtype == torch.float64}
            assert cast
            for version in (8, 9):
                early.expect(version)
                assert train_step(trainer, f"s{version}", seed=version) == version
                installed, stats = refit_in_place(early, version, engine)
                assert_exported(
                    trainer, {n: t.float() for n, t in installed.items()}, f"v{version}"
                )
                assert stats.before_readable
            assert stats.in_place_bytes == sum(t.nbytes for n, t in engine.items() if n not in cast)
            buffer = early.staging.buffer.untyped_storage().data_ptr()
            lives = {n for n, t in engine.items() if t.untyped_storage().data_ptr() == buffer}
            assert lives == engine.keys() - cast
            early.expect(10)
            assert train_step(trainer, "s10", seed=10) == 10
            with sidecar.client() as client:
                client.wait_visible(10, timeout=30)
            corrupted = corrupt_one_byte(sidecar, 10, rank0)
            with pytest.raises(RefitError, match=f"{corrupted} shard \\d .*crc32"):
                early.fetch(10, in_place=engine)
            for name, tensor in installed.items():
                assert torch.equal(engine[name], tensor), name
            early.expect(11)
            assert train_step(trainer, "s11", seed=11) == 11
            early.fetch(11, in_place=engine)
            early.abandon()
            for name, tensor in installed.items():
                assert torch.equal(engine[name], tensor), name
            assert early.installed_version == 9

            # A fetch without them: they leave staging first, holding version 9.
            early.expect(12)
            assert train_step(trainer, "s12", seed=12) == 12
            latest, _ = refit_with_stats(early, 12)
            assert_exported(trainer, latest, "v12")
            for name, tensor in installed.items():
                assert torch.equal(engine[name], tensor), name
                assert engine[name].untyped_storage().data_ptr() != buffer, name
            assert all(engine[n].dtype == torch.float64 for n in cast)

            # A lease asked ahead that has under half its TTL left at the fetch (a step
            # longer than half a TTL) is renewed beside the pull, not before it.
            renewals: list[str] = []
            real_renew = slow.client.renew_lease

            def renew(lease: Lease, ttl: float) -> Lease:
                renewals.append(lease.lease_id)
                return real_renew(lease, ttl)

            slow.client.renew_lease = renew  # type: ignore[method-assign]
            asked = time.monotonic()
            slow.expect(13)
            assert train_step(trainer, "s13", seed=13) == 13
            time.sleep(max(0.0, asked + 2.0 - time.monotonic()))  # 1 s of its 3 s left
            latest, stats = refit_with_stats(slow, 13)
            assert stats.expected and renewals
            assert_exported(trainer, latest, "v13")

            # A transformers model whose parameters live in staging computes what the
            # trainer's Forward does after a refit pulled into them (its logits, not only its
            # tensors).
            model = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(tmp_path / "trainer" / "builtin-model"),
                dtype=torch.float32,
            ).eval()
            params = dict(model.named_parameters())
            tensors = {name: params[name] for name in hf_names(spec)}
            for version in (14, 15):
                slow.expect(version)
                assert train_step(trainer, f"s{version}", seed=version) == version
                _, stats = refit_in_place(slow, version, tensors)
            assert stats.in_place_bytes > 0
            with torch.no_grad():
                computed = []
                for prompt in PROMPTS:
                    ids = torch.tensor([prompt])
                    logits = model(input_ids=ids).logits[0, :-1].float()
                    picked = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
                    computed.append(picked.numpy())
            assert gap(computed, trainer_logprobs(trainer)) < 1e-4
        finally:
            early.close()
            late.close()
            slow.close()
            whole.close()
            unverified.close()
            norms.close()
            assert trainer.stop() == 0
