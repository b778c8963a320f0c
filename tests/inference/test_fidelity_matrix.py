"""Refit fidelity across model families: for Llama, Mistral, Qwen2 and Qwen3, tied and untied,
with grouped, single (MQA) and full key/value heads, head_dim != hidden/heads, scaled RoPE (Llama
3's and YaRN, on prompts longer than the original context) and a vocabulary both sides pad, a
real trainer (TP=1, TP=2 or PP=2) trains two versions and real vLLM engines (TP=1, TP=2) refit
to each: their prompt logprobs equal the trainer's Forward.

Processes are shared: one engine host per engine TP builds each model's engine in turn and
refits it from every trainer layout; one trainer serves both versions. The default run covers
every family x tied/untied (each trainer layout for tied and for untied models, both engine
sizes), and the scaled-RoPE models at both TP=2 and PP=2; the slow run adds every remaining
(trainer layout, engine) pair. One model's trainer also exports a sharded checkpoint that an
engine then loads and serves: vLLM finds every key it needs in the files and no other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inference_ext.refit_options import ReceiverAuth, RefitOptions
from megatron_hf.spec import ModelFamily, ModelSpec
from megatron_hf.splits import trainer_layout_problems
from megatron_hf.tiny import write_tiny_checkpoint
from tests.support.engine import EngineHost
from tests.support.fidelity import (
    FIDELITY,
    PROMPTS,
    check_installed_slices,
    gap,
    train_step,
    trainer_logprobs,
)
from tests.support.sidecar import running_sidecar
from tests.support.trainer import TrainerProcess
from trainer_svc.domain import ExportDType


@dataclass(frozen=True)
class MatrixModel:
    family: ModelFamily
    tied: bool
    shape: dict[str, Any]
    """`write_tiny_checkpoint` arguments (vocabulary 101: padded by Megatron and vLLM)."""


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}
"""Llama 3.2's scaling with an original length the prompts pass (11 tokens > 8), so the
scaled frequencies matter; max_position_embeddings (256) is the extended length."""
YARN_ROPE = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 8}
"""YaRN as Qwen3 ships it (with a factor that makes vLLM's table, original x factor, as long
as the engines' 256 positions), its attention factor included."""

MODELS = {
    # head_dim 32 with hidden 64 and 4 heads: head_dim != hidden / heads. Llama 3.2's shape:
    # tied, grouped, scaled RoPE.
    "llama3-gqa-tied": MatrixModel(
        ModelFamily.LLAMA,
        True,
        {"num_key_value_heads": 2, "head_dim": 32, "rope_scaling": LLAMA3_ROPE},
    ),
    "llama-mqa": MatrixModel(ModelFamily.LLAMA, False, {"num_key_value_heads": 1, "head_dim": 32}),
    # Mistral is Llama's layout under vLLM's and transformers' Mistral classes.
    "mistral-mqa": MatrixModel(
        ModelFamily.MISTRAL, False, {"num_key_value_heads": 1, "head_dim": 32}
    ),
    # Qwen2 has q/k/v biases and head_dim = hidden / heads (32 is vLLM-CPU's smallest).
    "qwen2-gqa": MatrixModel(
        ModelFamily.QWEN2, False, {"hidden_size": 128, "num_key_value_heads": 2}
    ),
    "qwen2-mha-tied": MatrixModel(
        ModelFamily.QWEN2, True, {"hidden_size": 128, "num_key_value_heads": 4}
    ),
    # Qwen3 has q/k norms.
    "qwen3-yarn-gqa-tied": MatrixModel(
        ModelFamily.QWEN3,
        True,
        {"num_key_value_heads": 2, "head_dim": 32, "rope_scaling": YARN_ROPE},
    ),
    "qwen3-mha": MatrixModel(ModelFamily.QWEN3, False, {"num_key_value_heads": 4, "head_dim": 64}),
}
TRAINER_LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
ENGINE_TPS = (1, 2)
DEFAULT: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {
    "llama3-gqa-tied": (("pp2", "tp2"), (1, 2)),
    "mistral-mqa": (("pp2",), (1, 2)),
    "qwen2-gqa": (("tp2",), (1,)),
    "qwen2-mha-tied": (("pp2",), (1,)),
    "qwen3-yarn-gqa-tied": (("tp2", "pp2"), (1, 2)),
    "qwen3-mha": (("tp1",), (1,)),
}
"""The default run: trainer layouts and engine sizes per model. The scaled-RoPE models run at
both TP=2 and PP=2: the rotary tables are installed per stage and per TP rank. The untied
Llama layout runs as Mistral (the same tensors and conversion, another class on both sides);
llama-mqa itself runs in the slow run."""
SHARDED_EXPORT = "mistral-mqa"
"""The model whose trainer (at PP=2, so each stage writes its own files) exports a sharded
fp32 checkpoint that the TP=1 engine loads and serves."""
EXPORT_FILE_BYTES = 96 * 1024
"""Small enough that the tiny model's export spans several files."""


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, EngineHost]]:
    logs = tmp_path_factory.mktemp("engine-hosts")
    started: dict[int, EngineHost] = {}
    try:
        for tp in ENGINE_TPS:
            started[tp] = EngineHost(tp, logs / f"host-tp{tp}.log")
        yield started
    finally:
        for host in started.values():
            host.stop()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    written: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in written:
            model = MODELS[name]
            written[name] = write_tiny_checkpoint(
                tmp_path_factory.mktemp(name),
                model.family,
                num_layers=2,
                tie_word_embeddings=model.tied,
                seed=len(written) + 3,
                **model.shape,
            )
        return written[name]

    return get


def _trainable_layouts(path: Path) -> list[str]:
    spec = ModelSpec.from_pretrained_dir(path)
    return [
        name
        for name, (tp, pp) in TRAINER_LAYOUTS.items()
        if not trainer_layout_problems(spec, tensor_parallel=tp, pipeline_parallel=pp)
    ]


def _refit_matrix(
    name: str,
    path: Path,
    *,
    layouts: Sequence[str],
    engine_tps: Sequence[int],
    hosts: dict[int, EngineHost],
    workdir: Path,
) -> None:
    """Each layout's trainer trains two versions; every engine refits to each and must then
    compute the trainer's logprobs. Before the first refit the engines (loaded from the
    checkpoint) must equal the trainer's version 0."""
    for tp in engine_tps:
        hosts[tp].load(path)  # builds while the first trainer starts
    for index, layout in enumerate(layouts):
        tp_size, pp_size = TRAINER_LAYOUTS[layout]
        args = ["--tp", str(tp_size), "--pp", str(pp_size), "--model", str(path)]
        with running_sidecar(workdir / f"{layout}-sidecar") as sidecar:
            trainer = TrainerProcess(
                workdir / layout, [*args, *sidecar.trainer_args(), "--refit-slots", "2"]
            )
            try:
                if index == 0:
                    for tp in engine_tps:
                        hosts[tp].result()
                for tp in engine_tps:
                    options = RefitOptions(
                        receiver_id=f"{name}-{layout}-tp{tp}",
                        pull_timeout_s=60,
                        auth=ReceiverAuth(token_file=sidecar.token_file()),
                    )
                    hosts[tp].call("refit_init", sidecar.address, options)
                if index == 0:
                    initial = trainer_logprobs(trainer)
                    for tp in engine_tps:
                        loaded = hosts[tp].call("probe", PROMPTS)
                        assert gap(loaded, initial) <= FIDELITY, f"{name}: TP={tp} engine at load"
                for step in (1, 2):
                    version = train_step(trainer, f"s{step}", seed=step + 7 * index)
                    trained = trainer_logprobs(trainer)
                    for tp in engine_tps:
                        refit = hosts[tp].call("refit_to", version)
                        assert refit.version == version
                        served = hosts[tp].call("probe", PROMPTS)
                        difference = gap(served, trained)
                        assert difference <= FIDELITY, (
                            f"{name}: trainer {layout} -> TP={tp} engine, version {version}: "
                            f"logprobs differ by {difference:.2e}"
                        )
                exported = trainer.export(f"v{version}")
                for tp in engine_tps:
                    check_installed_slices(hosts[tp].call("slices", None), exported, tp)
                if name == SHARDED_EXPORT and index == len(layouts) - 1:
                    _serve_sharded_export(trainer, hosts[min(engine_tps)], trained)
            finally:
                assert trainer.stop() == 0


def _serve_sharded_export(
    trainer: TrainerProcess, host: EngineHost, trained: list[np.ndarray]
) -> None:
    """vLLM loads the trainer's sharded fp32 export (it raises on a weight the files lack) and
    computes the trainer's logprobs from it."""
    path = trainer.workdir / "exports" / "sharded"
    trainer.client.export_hf(path, dtype=ExportDType.FLOAT32, max_file_bytes=EXPORT_FILE_BYTES)
    files = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(files) >= 3 and (path / "model.safetensors.index.json").is_file(), files
    host.load(path)
    host.result()
    difference = gap(host.call("probe", PROMPTS), trained)
    assert difference <= FIDELITY, f"engine on the sharded export: logprobs differ by {difference}"


@pytest.mark.parametrize("name", sorted(DEFAULT))
def test_refit_fidelity(name, hosts, checkpoint, tmp_path):
    layouts, engine_tps = DEFAULT[name]
    path = checkpoint(name)
    assert set(layouts) <= set(_trainable_layouts(path))
    _refit_matrix(name, path, layouts=layouts, engine_tps=engine_tps, hosts=hosts, workdir=tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_refit_fidelity_every_layout(name, hosts, checkpoint, tmp_path):
    path = checkpoint(name)
    _refit_matrix(
        name,
        path,
        layouts=_trainable_layouts(path),
        engine_tps=ENGINE_TPS,
        hosts=hosts,
        workdir=tmp_path,
    )
